"""TimelineViewer: a Timeline drawn by the browser, replayed with Play, zoomed and hovered."""

from __future__ import annotations

import ipywidgets as w

from minipar.plots import render_summary
from minipar.trace import Timeline

from .figure_view import FigureView
from .gantt import GanttView, gantt_panel


class TimelineViewer(w.VBox):
    """A Gantt chart of a Timeline, one row per rank, with where each rank's time went.

    The chart is SVG drawn in the browser (`GanttView`): Play replays the run there in
    `play_ms`, without asking the kernel for frames; the wheel zooms the time axis and
    hovering an action shows its label, rank, micro-batch and times.
    """

    def __init__(self, timeline: Timeline, title: str = "", play_ms: int = 4000) -> None:
        if play_ms < 100:
            raise ValueError(f"play_ms must be >= 100 (one replay, in milliseconds); "
                             f"got {play_ms}")
        self.timeline = timeline
        title = title or f"{len(timeline)} events, makespan {timeline.makespan * 1e3:.1f} ms"
        self.view = GanttView(panels=[gantt_panel(timeline, title)], play_ms=play_ms)
        summary = FigureView()
        summary.show(render_summary(timeline))
        super().__init__([self.view, summary])
