"""MeshViewer (which rank holds what, and who it talks to along each dimension) and
PlannerExplorer (the planner's ranking for a model on a cluster you describe)."""

from __future__ import annotations

import ipywidgets as w

from minipar.cost import GB, OPT_CONFIGS
from minipar.mesh import Mesh
from minipar.mesh.planner import Hardware, explain, plan

from .figure_view import FigureView
from .labels import full_labels
from .mesh_view import render_mesh, render_plans

_SIZES = [1, 2, 4, 8]


class MeshViewer(w.VBox):
    """Sizes of dp, pp and tp -> the mesh's ranks as boxes saying what each holds. Click a
    rank to see its group along every dimension; pick the dimension that colours them."""

    def __init__(self, dp: int = 2, pp: int = 2, tp: int = 2, layers: int = 8) -> None:
        self.layers = layers
        self.sizes = {n: w.Dropdown(options=_SIZES, value=v, description=n,
                                    layout=w.Layout(width="140px"))
                      for n, v in (("dp", dp), ("pp", pp), ("tp", tp))}
        self.colour_by = w.ToggleButtons(options=["tp", "pp", "dp"], value="tp",
                                         description="shade by")
        self.ranks = w.ToggleButtons(description="rank", style={"button_width": "44px"})
        self.status = w.HTML()
        self.view = FigureView()
        for control in self.sizes.values():
            control.observe(lambda _: self._reset_ranks(), names="value")
        self.colour_by.observe(lambda _: self.draw(), names="value")
        self.ranks.observe(lambda _: self.draw(), names="value")
        super().__init__([w.HBox(list(self.sizes.values())), self.colour_by, self.ranks,
                          self.status, self.view])
        full_labels(self)
        self._reset_ranks()

    @property
    def mesh(self) -> Mesh:
        return Mesh(**{n: c.value for n, c in self.sizes.items()})

    def _reset_ranks(self) -> None:
        """A new shape: one button per rank, rank 0 selected, then draw."""
        self.ranks.unobserve_all("value")
        self.ranks.options = list(range(self.mesh.size))
        self.ranks.value = 0
        self.ranks.observe(lambda _: self.draw(), names="value")
        self.draw()

    def groups_text(self, rank: int) -> str:
        """`rank`'s coordinates and its group along every dimension, in words."""
        mesh = self.mesh
        coords = ", ".join(f"{n}={v}" for n, v in mesh.coords(rank).items())
        groups = " &middot; ".join(f"<b>{n}</b> group {mesh.group_of(n, rank)}"
                                   for n in mesh.names)
        return f"rank {rank} ({coords}): {groups}"

    def draw(self) -> None:
        mesh, rank = self.mesh, self.ranks.value
        self.status.value = self.groups_text(rank)
        self.view.show(render_mesh(mesh, rank, self.colour_by.value, self.layers))


class PlannerExplorer(w.VBox):
    """A model (OPT sizes) and a cluster (nodes, devices per node, memory, NIC) -> every
    configuration that fits, ranked by the planner's estimated step time, the winner
    explained; the `shown` fastest drawn with where their time goes and their memory."""

    def __init__(self, model: str = "13B", nodes: int = 2, devices_per_node: int = 8,
                 memory_gb: float = 80, nic_gbps: float = 200, global_batch: int = 64,
                 shown: int = 10) -> None:
        self.shown = shown
        self.model = w.Dropdown(options=list(OPT_CONFIGS), value=model, description="model")
        self.nodes = w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=nodes,
                                description="nodes")
        self.per_node = w.Dropdown(options=[1, 2, 4, 8], value=devices_per_node,
                                   description="per node")
        self.memory = w.FloatSlider(value=memory_gb, min=8, max=192, step=8,
                                    description="device GB", continuous_update=False)
        self.nic = w.Dropdown(options=[10, 25, 100, 200, 400, 800], value=nic_gbps,
                              description="NIC Gb/s")
        self.batch = w.Dropdown(options=[16, 32, 64, 128, 256, 512, 1024, 2048],
                                value=global_batch, description="batch")
        self.status = w.HTML()
        self.view = FigureView()
        self.plans: list = []
        for control in (self.model, self.nodes, self.per_node, self.memory, self.nic,
                        self.batch):
            control.observe(lambda _: self.draw(), names="value")
        super().__init__([w.HBox([self.model, self.nodes, self.per_node]),
                          w.HBox([self.memory, self.nic, self.batch]), self.status,
                          self.view])
        full_labels(self)
        self.draw()

    @property
    def cluster(self) -> Hardware:
        """A100-like devices (312 TFLOP/s, 300 GB/s inside a node) with the chosen rest."""
        return Hardware(self.nodes.value, self.per_node.value, 312e12, self.memory.value * GB,
                       300e9, self.nic.value * 1e9 / 8,
                       name=f"{self.nodes.value} x {self.per_node.value} devices")

    def draw(self) -> None:
        model, cluster = OPT_CONFIGS[self.model.value], self.cluster
        self.plans = plan(model, cluster, self.batch.value)
        if not self.plans:
            self.status.value = (
                f"<b>Nothing fits</b>: OPT-{self.model.value} on {cluster.devices} devices of "
                f"{self.memory.value:.0f} GB with a batch of {self.batch.value} has no "
                "configuration within memory. Add devices or memory, or pick a smaller model.")
            self.view.greyed = "nothing fits (the picture is of the last choice that did)"
            return
        self.status.value = (f"{len(self.plans)} configurations fit. <b>Winner</b>: "
                             + explain(self.plans[0], cluster, self.plans))
        title = (f"OPT-{self.model.value} on {cluster.devices} devices ({cluster.nodes} nodes "
                 f"x {cluster.devices_per_node}, {self.nic.value} Gb/s NICs), batch "
                 f"{self.batch.value}: the {min(self.shown, len(self.plans))} fastest")
        self.view.show(render_plans(self.plans[:self.shown], cluster, title))
