"""AllToAllAnimator: a flat or hierarchical all-to-all of routed rows, step by step."""

from __future__ import annotations

import ipywidgets as w

from .exchange_view import STEP_NAMES, render_exchange, routed_counts
from .figure_view import FigureView
from .labels import full_labels

LAYOUTS = {"2 nodes x 2": (2, 2), "2 nodes x 4": (2, 4), "4 nodes x 2": (4, 2),
           "3 nodes x 4": (3, 4)}


class AllToAllAnimator(w.VBox):
    """Layout (nodes x ranks per node), flat or hierarchical, and how skewed the router is
    -> one `render_exchange` frame per step, sent to the browser as SVG; Play walks the
    steps there."""

    def __init__(self, layout: str = "2 nodes x 4", kind: str = "hierarchical",
                 skew: float = 1.0, rows: int = 8) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}; got {layout!r}")
        if kind not in ("flat", "hierarchical"):
            raise ValueError(f"kind must be 'flat' or 'hierarchical'; got {kind!r}")
        self.rows = rows
        self.topology = w.Dropdown(options=list(LAYOUTS), value=layout, description="layout")
        self.kind = w.ToggleButtons(options=["flat", "hierarchical"], value=kind,
                                    description="all-to-all")
        self.skew = w.FloatSlider(value=skew, min=0.0, max=3.0, step=0.5,
                                  description="router skew", continuous_update=False)
        self.status = w.HTML()
        self.view = FigureView(frame_ms=1500)
        for control in (self.topology, self.kind, self.skew):
            control.observe(lambda _: self.draw(), names="value")
        super().__init__([w.HBox([self.topology, self.skew]), self.kind, self.status,
                          self.view])
        full_labels(self)
        self.draw()

    def counts(self) -> list[list[int]]:
        nodes, per_node = LAYOUTS[self.topology.value]
        return routed_counts(nodes * per_node, self.rows, self.skew.value)

    def draw(self) -> None:
        """Draw every step of the current choice (flat: before and after the one
        exchange; hierarchical: the gather inside nodes, then the exchange across)."""
        nodes, per_node = LAYOUTS[self.topology.value]
        k = nodes * per_node
        self.status.value = (f"{k} ranks: a flat all-to-all sends each rank up to "
                             f"{k - per_node} messages across nodes; the hierarchical one "
                             f"{nodes - 1}, each aggregating {per_node} ranks' rows.")
        counts, kind = self.counts(), self.kind.value
        steps = 2 if kind == "flat" else 3
        captions = [STEP_NAMES[(kind, s)] for s in range(steps)]
        self.view.show(*(render_exchange(counts, nodes, per_node, kind, s) for s in range(steps)),
                       captions=captions, frame=min(self.view.frame, steps - 1))
