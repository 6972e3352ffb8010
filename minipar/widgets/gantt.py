"""GanttView: Timelines drawn by the browser.

Python computes (simulate, measure on real ranks) and sends each Timeline as plain data;
a small ES module (gantt.js, no build step, loaded by anywidget) draws it as SVG: crisp
at any width, hover shows an action's label, rank, micro-batch and times, the mouse
wheel zooms the time axis (double-click resets), and Play replays the run in the
browser without asking the kernel for frames, so it also plays on a static page.
"""

from __future__ import annotations

import anywidget
import traitlets

from minipar.plots import kind_colors
from minipar.trace import Timeline

from .esm import esm


def gantt_panel(timeline: Timeline, title: str, axis_ms: float | None = None,
                plays: bool = True) -> dict:
    """One panel's data: a lane per rank, each event as [lane, kind, label, start ms,
    end ms, micro-batch, on the compute track]; `axis_ms` shares a time axis between
    panels; `plays` says whether the Play cursor replays this panel."""
    ranks = timeline.ranks
    t0 = timeline.start
    events = [[ranks.index(e.rank), e.kind, e.label, round((e.start - t0) * 1e3, 4),
               round((e.end - t0) * 1e3, 4), e.microbatch, e.track == "compute"]
              for e in timeline]
    return {"kind": "gantt", "title": title, "lanes": [f"rank {r}" for r in ranks],
            "axis_ms": axis_ms or max(timeline.makespan * 1e3, 1e-6), "events": events,
            "colors": kind_colors(timeline), "plays": plays}


def step_panel(series: dict[int, list[tuple[float, float]]], title: str, ylabel: str,
               axis_ms: float, plays: bool = True) -> dict:
    """A panel of step curves over time (seconds in, ms drawn), one per rank: what each
    rank holds, say. Its y axis has whole-number ticks."""
    return {"kind": "steps", "title": title, "ylabel": ylabel, "axis_ms": axis_ms,
            "plays": plays,
            "series": [{"name": f"rank {r}", "points": [[round(t * 1e3, 4), y] for t, y in pts]}
                       for r, pts in series.items()]}


class GanttView(anywidget.AnyWidget):
    """Panels (from `gantt_panel` / `step_panel`) drawn as SVG in the browser. Set
    `greyed` to a reason when the input that produced the panels is no longer valid: the
    picture greys out and says why, so what you see is always the current input."""

    _esm = esm("gantt.js")
    panels = traitlets.List().tag(sync=True)
    greyed = traitlets.Unicode("").tag(sync=True)
    play_ms = traitlets.Int(4000).tag(sync=True)  # one replay, start to end
