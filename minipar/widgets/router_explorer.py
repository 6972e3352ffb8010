"""RouterExplorer: where an MoE gate sends each token, who gets dropped, and how training
with the balance loss changes it. `render_routing` is pure; the widget is the glue."""

from __future__ import annotations

import ipywidgets as w
import torch
from matplotlib.figure import Figure

from minipar.moe import MoELayer, Routing, imbalance, train_router_stats

from .figure_view import FigureView
from .labels import full_labels


def render_routing(routing: Routing, title: str = "") -> Figure:
    """Tokens x experts heat map of gate probabilities (choice order written in the cell,
    dropped choices crossed in red), and each expert's load against its capacity."""
    probs = routing.probs.detach()
    tokens, experts = probs.shape
    fig = Figure(figsize=(10, max(3.0, 0.16 * tokens + 1.2)), layout="constrained")
    heat, bars = fig.subplots(1, 2, width_ratios=[1.2, 1])
    top = float(probs.max())
    heat.imshow(probs.numpy(), aspect="auto", cmap="Blues", vmin=0, vmax=top)
    for t in range(tokens):
        for j in range(routing.expert.shape[1]):
            e = int(routing.expert[t, j])
            kept = bool(routing.slot[t, j] >= 0)
            dark = float(probs[t, e]) > 0.55 * top  # light marks on dark cells
            color = ("white" if dark else "black") if kept else ("#FFD54F" if dark else "red")
            heat.text(e, t, str(j + 1) if kept else "x", ha="center", va="center", fontsize=7,
                      color=color, fontweight="bold")
    heat.set_xlabel("expert")
    heat.set_ylabel("token")
    heat.set_xticks(range(experts))
    heat.set_title("gate probabilities (1, 2 = choice kept, x = dropped)", fontsize=9)
    kept_load = routing.load(experts)
    wanted = torch.bincount(routing.expert.reshape(-1), minlength=experts)
    bars.bar(range(experts), kept_load.tolist(), color="#4C72B0", label="processed")
    bars.bar(range(experts), (wanted - kept_load).tolist(), bottom=kept_load.tolist(),
             color="#C44E52", label="dropped")
    bars.axhline(routing.capacity, color="black", linestyle="--", label="capacity")
    bars.set_xticks(range(experts))
    bars.set_xlabel("expert")
    bars.set_ylabel("token choices")
    bars.yaxis.get_major_locator().set_params(integer=True)  # a count: no 2.5
    bars.legend(fontsize=7)
    bars.set_title(f"balance loss {routing.balance_loss.item():.3f}, z-loss "
                   f"{routing.z_loss.item():.2f}, drops {routing.drop_rate:.0%}, imbalance "
                   f"{imbalance(kept_load):.2f}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    return fig


class RouterExplorer(w.VBox):
    """Controls for k, capacity factor, noisy gating and the number of experts; "train"
    runs a few SGD steps with the balance loss and redraws, so the balance can be watched
    changing."""

    def __init__(self, tokens: int = 32, hidden: int = 16) -> None:
        self.k = w.IntSlider(min=1, max=4, value=2, description="k", continuous_update=False)
        self.factor = w.FloatSlider(min=0.25, max=2.0, step=0.25, value=1.0,
                                    description="capacity", continuous_update=False)
        self.noisy = w.Checkbox(value=False, description="noisy gate")
        self.experts = w.IntSlider(min=2, max=16, value=8, description="experts",
                                   continuous_update=False)
        self.train = w.Button(description="train 20 steps", button_style="primary")
        self.view, self.status = FigureView(), w.HTML()
        self.hidden = hidden
        self.x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).abs()
        self.target = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
        self.layer: MoELayer | None = None
        self.steps = 0
        for control in (self.k, self.factor, self.noisy, self.experts):
            control.observe(lambda _: self.build(), names="value")
        self.train.on_click(lambda _: self.step())
        super().__init__([w.HBox([self.k, self.factor]),
                          w.HBox([self.experts, self.noisy, self.train]), self.status,
                          self.view])
        full_labels(self)
        self.build()

    def build(self) -> None:
        """A fresh, untrained layer for the controls' values (or greys an impossible k)."""
        k, experts = self.k.value, self.experts.value
        if k > experts:
            self.status.value = (f"<b>k must be at most the number of experts</b>: k = {k}, "
                                 f"experts = {experts}. Lower k or add experts.")
            self.view.greyed = ("k is more than the number of experts (the picture is of "
                                "the last valid choice)")
            return
        self.steps = 0  # a new layer starts untrained
        self.layer = MoELayer(self.hidden, 2 * self.hidden, experts, k, self.factor.value,
                              noisy=self.noisy.value, seed=2)
        with torch.no_grad():  # start from a skewed router, as an untrained one can be
            self.layer.gate.router.weight[0] += 0.3
        self.draw("untrained")

    def draw(self, label: str) -> None:
        with torch.no_grad():
            self.layer(self.x)
        self.view.show(render_routing(self.layer.last_routing, label))
        self.status.value = ""

    def step(self) -> None:
        """Train 20 SGD steps with the balance loss, then redraw."""
        if self.view.greyed:  # the controls describe no valid layer: nothing to train
            return
        history = train_router_stats(self.layer, self.x, self.target, 20, lr=0.2,
                                     balance_weight=0.5)
        self.steps += 20
        self.draw(f"after {self.steps} training steps (last loss {history[-1]['loss']:.3f})")
