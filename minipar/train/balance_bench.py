"""`minipar bench moe-balance`: the experts' load over a few hundred steps of the tiny
decoder with a mixture of experts, with no balancing, the auxiliary loss, and the
loss-free bias, trained from the same weights on the same batches.

The figure is the load imbalance each step logs: the busiest expert's token choices over
the mean expert's (1 is even, E is everything on one expert), averaged over the blocks.
The table reads it over the last steps, where the router has had time to drift, beside
each run's final losses: balancing is worth it only if it costs the model little.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..report import format_table, progress, save_results
from ..runtime import launch
from .config import load_config
from .loop import train

STEPS, LAST = 300, 100  # the run, and the last steps the table averages over
EXPERTS, AUX_COEF, BIAS_RATE = 4, 0.01, 0.01
# DeepSeek-V3's rate is 0.001 over hundreds of thousands of steps; a run this short
# needs a larger one to move the bias as far
RUNS = ("none", "aux", "bias")


def imbalance(loads: list[list[float]]) -> float:
    """The busiest expert's load over the mean expert's, averaged over the blocks."""
    return statistics.fmean(max(block) / statistics.fmean(block) for block in loads)


def _config(kind: str, steps: int):
    return load_config("tiny", {"model.experts": EXPERTS, "model.balance": kind,
                                "model.balance_coef": AUX_COEF, "model.bias_rate": BIAS_RATE,
                                "train.steps": steps, "train.eval_every": steps,
                                "optim.warmup_steps": min(50, steps // 5)})


def measure(steps: int = STEPS, last: int = LAST) -> list[dict]:
    """One row per balance: its imbalance curve, the mean over the last steps, and the
    final training and validation losses."""
    rows = []
    for kind in RUNS:
        progress(f"balance {kind}, {steps} steps")
        run = launch(train, 1, _config(kind, steps), None)[0]
        curve = [imbalance(r["expert_load"]) for r in run.records]
        rows.append({"balance": kind, "curve": curve,
                     "imbalance_last": statistics.fmean(curve[-last:]),
                     "imbalance_first": statistics.fmean(curve[:last]),
                     "loss": statistics.fmean(r["loss"] for r in run.records[-last:]),
                     "val_loss": run.records[-1]["val_loss"]})
    return rows


def figure(rows: list[dict]):
    """Imbalance (max/mean load) against step, one line per balance."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for r in rows:
        ax.plot(range(1, len(r["curve"]) + 1), r["curve"], label=r["balance"], linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")  # perfectly even
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean expert")
    ax.legend(fontsize=8)
    return fig


def report(rows: list[dict], out_dir: Path) -> str:
    save_results(rows, figure(rows), out_dir, "moe-balance",
                 title=f"expert load while training, tiny decoder with {EXPERTS} experts")
    steps, last = len(rows[0]["curve"]), min(LAST, len(rows[0]["curve"]))
    shown = [{"balance": r["balance"], "first": f"{r['imbalance_first']:.3f}",
              "last": f"{r['imbalance_last']:.3f}", "loss": f"{r['loss']:.4f}",
              "val": f"{r['val_loss']:.4f}"} for r in rows]
    return (f"expert load, tiny decoder with {EXPERTS} experts (top-2), {steps} steps, one "
            f"rank: busiest expert's token choices over the mean's (1 = even); auxiliary "
            f"loss coefficient {AUX_COEF}, bias rate {BIAS_RATE}\n"
            + format_table(shown, [("balance", "balance"),
                                   ("first", f"max/mean, first {last} steps"),
                                   ("last", f"max/mean, last {last}"),
                                   ("loss", f"training loss, last {last}"),
                                   ("val", "validation loss")]))
