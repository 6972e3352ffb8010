"""AllToAllAnimator: a flat or hierarchical all-to-all of routed rows, step by step."""

from __future__ import annotations

import ipywidgets as w

from minipar.plots import to_png

from .exchange_view import render_exchange, routed_counts

LAYOUTS = {"2 nodes x 2": (2, 2), "2 nodes x 4": (2, 4), "4 nodes x 2": (4, 2),
           "3 nodes x 4": (3, 4)}


class AllToAllAnimator(w.VBox):
    """Layout (nodes x ranks per node), flat or hierarchical, and how skewed the router is
    -> `render_exchange` at each step; Play walks the steps."""

    def __init__(self, layout: str = "2 nodes x 4", kind: str = "hierarchical",
                 skew: float = 1.0, rows: int = 8) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}; got {layout!r}")
        self.rows = rows
        self.topology = w.Dropdown(options=list(LAYOUTS), value=layout, description="layout")
        self.kind = w.ToggleButtons(options=["flat", "hierarchical"], value=kind,
                                    description="all-to-all")
        self.skew = w.FloatSlider(value=skew, min=0.0, max=3.0, step=0.5,
                                  description="router skew", continuous_update=False)
        self.stage = w.IntSlider(min=0, max=2, value=0, description="step")
        self.play = w.Play(min=0, max=2, interval=1500, description="play")
        w.jslink((self.play, "value"), (self.stage, "value"))
        self.status = w.HTML()
        self.image = w.Image(format="png")
        for control in (self.topology, self.kind, self.skew):
            control.observe(lambda _: self._reset(), names="value")
        self.stage.observe(lambda _: self.draw(), names="value")
        super().__init__([w.HBox([self.topology, self.skew]), self.kind,
                          w.HBox([self.play, self.stage]), self.status, self.image])
        self._reset()

    def _reset(self) -> None:
        last = 1 if self.kind.value == "flat" else 2
        self.stage.max = self.play.max = last
        self.stage.value = min(self.stage.value, last)
        self.draw()

    def counts(self) -> list[list[int]]:
        nodes, per_node = LAYOUTS[self.topology.value]
        return routed_counts(nodes * per_node, self.rows, self.skew.value)

    def draw(self) -> None:
        nodes, per_node = LAYOUTS[self.topology.value]
        k = nodes * per_node
        across_flat = k - per_node
        self.status.value = (f"{k} ranks: a flat all-to-all sends each rank up to "
                             f"{across_flat} messages across nodes; the hierarchical one "
                             f"{nodes - 1}, each aggregating {per_node} ranks' rows.")
        self.image.value = to_png(render_exchange(self.counts(), nodes, per_node,
                                                  self.kind.value, self.stage.value))
