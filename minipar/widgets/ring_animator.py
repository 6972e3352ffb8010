"""RingAnimator: ring attention step by step for K ranks, causal or not, contiguous or
balanced; Play (in the browser) moves the key/value blocks round the ring."""

from __future__ import annotations

import ipywidgets as w

from .figure_view import FigureView
from .labels import full_labels
from .ring_view import render_ring


class RingAnimator(w.VBox):
    """Ranks, causal mask and layout -> one `render_ring` frame per step, all drawn when
    a control changes and sent to the browser as SVG, so Play is smooth and needs no
    kernel."""

    def __init__(self, ranks: int = 4, causal: bool = True, balanced: bool = False) -> None:
        self.ranks = w.Dropdown(options=[2, 3, 4, 6, 8], value=ranks, description="ranks")
        self.causal = w.Checkbox(value=causal, description="causal mask")
        self.balanced = w.Checkbox(value=balanced, description="balanced (zig-zag)")
        self.status = w.HTML()
        self.view = FigureView()
        for control in (self.ranks, self.causal, self.balanced):
            control.observe(lambda _: self.draw(), names="value")
        super().__init__([w.HBox([self.ranks, self.causal, self.balanced]), self.status,
                          self.view])
        full_labels(self)
        self.draw()

    def draw(self) -> None:
        """Draw every step of the current choice; an impossible one greys the picture."""
        k, causal, balanced = self.ranks.value, self.causal.value, self.balanced.value
        if balanced and not causal:
            self.status.value = ("<b>balanced</b> only helps causal attention: without the "
                                 "mask every rank already does equal work. Tick <b>causal "
                                 "mask</b> or untick balanced.")
            self.view.greyed = ("balanced needs the causal mask (the picture is of the last "
                                "valid choice)")
            return
        self.status.value = (f"{k} ranks, {'causal' if causal else 'full'} attention, "
                             f"{'balanced (zig-zag)' if balanced else 'contiguous'} blocks: "
                             f"{k} steps, one per key/value block.")
        captions = [f"step {s} (of 0-{k - 1}): rank r attends its queries to the key/value block "
                    f"that started on rank r - {s}, while that block moves on to rank r + 1"
                    for s in range(k)]
        self.view.show(*(render_ring(k, s, causal, balanced) for s in range(k)),
                       captions=captions, frame=min(self.view.frame, k - 1))
