"""RingAnimator: ring attention step by step for K ranks, causal or not, contiguous or
balanced; Play moves the key/value blocks round the ring."""

from __future__ import annotations

import ipywidgets as w

from minipar.plots import to_png

from .ring_view import render_ring


class RingAnimator(w.VBox):
    """Ranks, causal mask and layout -> `render_ring` at the chosen step. Frames are drawn
    once per setting and cached, so Play is smooth."""

    def __init__(self, ranks: int = 4, causal: bool = True, balanced: bool = False) -> None:
        self.ranks = w.Dropdown(options=[2, 3, 4, 6, 8], value=ranks, description="ranks")
        self.causal = w.Checkbox(value=causal, description="causal mask")
        self.balanced = w.Checkbox(value=balanced, description="balanced (zig-zag)")
        self.step = w.IntSlider(min=0, max=ranks - 1, value=0, description="step")
        self.play = w.Play(min=0, max=ranks - 1, interval=1200, description="play")
        w.jslink((self.play, "value"), (self.step, "value"))
        self.status = w.HTML()
        self.image = w.Image(format="png")
        self._frames: dict[tuple, bytes] = {}
        for control in (self.ranks, self.causal, self.balanced):
            control.observe(lambda _: self._reset(), names="value")
        self.step.observe(lambda _: self.draw(), names="value")
        super().__init__([w.HBox([self.ranks, self.causal, self.balanced]),
                          w.HBox([self.play, self.step]), self.status, self.image])
        self._reset()

    def _reset(self) -> None:
        last = self.ranks.value - 1
        self.step.max = self.play.max = last
        self.step.value = min(self.step.value, last)
        self.draw()

    def draw(self) -> None:
        k, causal, balanced = self.ranks.value, self.causal.value, self.balanced.value
        if balanced and not causal:
            self.status.value = ("<b>balanced</b> only helps causal attention: without the "
                                 "mask every rank already does equal work. Tick <b>causal "
                                 "mask</b> or untick balanced.")
            self.image.layout.opacity = "0.25"
            return
        self.image.layout.opacity = "1"
        key = (k, self.step.value, causal, balanced)
        if key not in self._frames:
            self._frames[key] = to_png(render_ring(k, self.step.value, causal, balanced))
        self.image.value = self._frames[key]
        self.status.value = (f"step {self.step.value} of {k}: rank r attends its queries to "
                             f"the key/value block that started on rank r - "
                             f"{self.step.value}, while that block moves on to rank r + 1.")
