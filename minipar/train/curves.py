"""A run's pictures: the loss curves (training per step, validation where evaluated), a
mixture's expert load per block, and the Timeline of one traced step, saved beside
metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from ..plots import to_png
from ..trace import Event, Timeline

STYLES = ("-", "--", ":", "-.")  # overlaid curves stay visible when they coincide


def render_curves(runs: dict[str, list[dict]], title: str = "", overlay: bool = False
                  ) -> Figure:
    """Loss against step for each named run's records (metrics.jsonl's objects): the
    training loss as a line, the validation loss as dots. With `overlay` (curves meant
    to coincide, as in `minipar train compare`) the first is drawn thick and the others
    thinner and dashed on top of it, so equal curves still show every run."""
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i}"
        # the noisy training loss drawn light, so the validation points on it stand out
        style = dict(linestyle=STYLES[i % len(STYLES)], linewidth=3 if i == 0 else 1.2,
                     alpha=0.5 if i == 0 else 1.0) if overlay else dict(linewidth=1, alpha=0.45)
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], color=color,
                label=f"{name}: training", **style)
        evaluated = [r for r in records if "val_loss" in r]
        ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-",
                color=color, markersize=5, linewidth=1.5, markeredgecolor="black",
                markeredgewidth=0.6, zorder=3, label=f"{name}: validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend(fontsize=8)
    ax.set_title(title or "loss", fontsize=10)
    return fig


def render_loads(records: list[dict]) -> Figure:
    """Each block's expert load against step (metrics.jsonl's `expert_load`): the busiest
    expert's token choices over the mean expert's, 1 when even."""
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    logged = [r for r in records if "expert_load" in r]
    for block in range(len(logged[0]["expert_load"])):
        ax.plot([r["step"] for r in logged],
                [max(loads) * len(loads) / sum(loads)
                 for loads in (r["expert_load"][block] for r in logged)],
                linewidth=1, label=f"block {block}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean")
    ax.legend(fontsize=8)
    ax.set_title("expert load per block", fontsize=10)
    return fig


def save_run_pictures(out: Path, records: list[dict], events: list[Event]) -> None:
    """loss.png from the records, load.png for a mixture of experts; step.trace.json
    (open in Perfetto) from the traced step's events of every rank."""
    fig = render_curves({"this run": records}, title="training and validation loss")
    (out / "loss.png").write_bytes(to_png(fig))
    if any("expert_load" in r for r in records):
        (out / "load.png").write_bytes(to_png(render_loads(records)))
    if events:
        Timeline(events).save_chrome(out / "step.trace.json")
