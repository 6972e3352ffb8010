"""A run's pictures: the loss curves (training per step, validation where evaluated) and
the Timeline of one traced step, saved beside metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from ..plots import to_png
from ..trace import Event, Timeline


def render_curves(runs: dict[str, list[dict]], title: str = "") -> Figure:
    """Loss against step for each named run's records (metrics.jsonl's objects): the
    training loss as a line, the validation loss as dots."""
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i}"
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], color=color,
                linewidth=1, label=f"{name}: training")
        evaluated = [r for r in records if "val_loss" in r]
        ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o",
                color=color, markersize=4, label=f"{name}: validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend(fontsize=8)
    ax.set_title(title or "loss", fontsize=10)
    return fig


def save_run_pictures(out: Path, records: list[dict], events: list[Event]) -> None:
    """loss.png from the records; step.trace.json (open in Perfetto) from the traced step's
    events of every rank."""
    fig = render_curves({"this run": records}, title="training and validation loss")
    (out / "loss.png").write_bytes(to_png(fig))
    if events:
        Timeline(events).save_chrome(out / "step.trace.json")
