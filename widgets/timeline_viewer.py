"""TimelineViewer: scrub or play through a Timeline, one row per rank."""

from __future__ import annotations

import ipywidgets as w

from minipar.plots import render_summary, render_timeline, to_png
from minipar.trace import Timeline


class TimelineViewer(w.VBox):
    """A Gantt chart of a Timeline with a Play button that replays it in `frames` steps.

    Frames are rendered once and cached, so playing twice costs nothing; the Play
    control drives the slider in the browser (jslink), and the slider only asks the
    kernel for a frame when it settles.
    """

    def __init__(self, timeline: Timeline, frames: int = 24, title: str = "",
                 interval_ms: int = 150) -> None:
        if frames < 1:
            raise ValueError(f"frames must be >= 1; got {frames}")
        self.timeline, self.frames, self.title = timeline, frames, title
        self._cache: dict[int, bytes] = {}
        self.image = w.Image(format="png", value=self._frame(frames))
        self.play = w.Play(min=0, max=frames, value=frames, interval=interval_ms,
                           description="play")
        self.slider = w.IntSlider(min=0, max=frames, value=frames, description="time",
                                  continuous_update=False, readout=False)
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.slider.observe(self._on_time, names="value")
        self.caption = w.HTML(self._caption(frames))
        summary = w.Image(format="png", value=to_png(render_summary(timeline)))
        super().__init__([w.HBox([self.play, self.slider, self.caption]), self.image, summary])

    def _frame(self, index: int) -> bytes:
        if index not in self._cache:
            upto = None if index == self.frames else self.timeline.makespan * index / self.frames
            self._cache[index] = to_png(render_timeline(self.timeline, upto=upto,
                                                        title=self.title))
        return self._cache[index]

    def _caption(self, index: int) -> str:
        return f"t = {self.timeline.makespan * 1e3 * index / self.frames:.1f} ms"

    def _on_time(self, change: dict) -> None:
        self.image.value = self._frame(change["new"])
        self.caption.value = self._caption(change["new"])
