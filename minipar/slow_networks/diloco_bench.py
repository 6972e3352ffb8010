"""`minipar bench diloco`: the bytes each rank sends before the model reaches a target
loss, DiLoCo (inner AdamW, the paper's outer Nesterov step) at several H against
synchronous data parallelism with the same AdamW (one gradient all-reduce per step).

Every method trains the same model from the same weights on the same batches, in
float64, on 2 ranks, and is evaluated on the same held-out set after every step (DDP)
or round (DiLoCo: only the global parameters count; the workers' own drift between
rounds is not a model anyone has). The target is the held-out loss DDP reaches at
TARGET_AT of its steps, so every method has a fair goal; bytes come from the meter, so
they are exact, and no figure here is a time.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .. import collectives
from ..data_parallel import DataParallel, shard
from ..models import mlp, mse, regression_data
from ..report import format_table, progress, save_results
from ..runtime import Cluster
from .diloco import OUTER_LR, OUTER_MOMENTUM, OptimizerReplica, diloco

WIDTH, BATCH, STEPS, LR = 64, 64, 240, 3e-3
# (H inner steps per round, outer lr, outer momentum): the paper's outer step at three H,
# and at the smallest H the outer step of local SGD (rate 1, no momentum) beside it
RUNS = ((4, OUTER_LR, OUTER_MOMENTUM), (16, OUTER_LR, OUTER_MOMENTUM),
        (48, OUTER_LR, OUTER_MOMENTUM), (4, 1.0, 0.0))
TARGET_AT = 0.5  # the target: DDP's held-out loss after this share of its steps


def _model() -> torch.nn.Module:
    return mlp([16, WIDTH, WIDTH, 1], seed=3, dtype=torch.float64)


def _data() -> tuple[list, tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches and a held-out set of 512 samples, from one seeded draw."""
    x, y = regression_data(STEPS * BATCH + 512, 16, seed=5, dtype=torch.float64)
    train = list(zip(x[:-512].split(BATCH), y[:-512].split(BATCH), strict=True))
    return train, (x[-512:], y[-512:])


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _curve(method: str, h: int = 1, outer_lr: float = OUTER_LR,
           outer_momentum: float = OUTER_MOMENTUM) -> list[tuple[int, int, float]]:
    """On one rank: (step, bytes this rank sent so far, held-out loss) after each step
    (DDP) or round (DiLoCo)."""
    train, (hx, hy) = _data()
    model, curve = _model(), []
    # built outside the meter: its start-up broadcast is not training traffic
    ddp = DataParallel(model, bucket_bytes=None, overlap=False) if method == "ddp" else None
    with collectives.meter() as meter:
        def held_out(step: int, *_theta: torch.Tensor) -> None:
            # after a DiLoCo round the model holds the global parameters: evaluate it as is
            with torch.no_grad():
                curve.append((step + 1, meter.sent_bytes, mse(model(hx), hy).item()))

        if ddp is None:
            diloco(OptimizerReplica(model, mse, _adamw(model.parameters())), train, h,
                   outer_lr, outer_momentum, on_round=held_out)
        else:
            opt = _adamw(model.parameters())
            for step, (x, y) in enumerate(train):
                opt.zero_grad()
                mse(ddp(shard(x)), shard(y)).backward()  # gradients averaged by its end
                opt.step()
                held_out(step)
    return curve


def _reached(curve: list[tuple[int, int, float]], target: float) -> tuple[int, int] | None:
    """(step, bytes) at the first point at or under the target, or None."""
    return next(((s, b) for s, b, loss in curve if loss <= target), None)


def _name(h: int, outer_lr: float, outer_momentum: float) -> str:
    if (outer_lr, outer_momentum) == (OUTER_LR, OUTER_MOMENTUM):
        return f"DiLoCo H={h}"
    return f"DiLoCo H={h}, outer lr {outer_lr:g}, momentum {outer_momentum:g}"


def measure(runs: tuple[tuple[int, float, float], ...] = RUNS) -> list[dict]:
    """One row per method: bytes and steps to the target, final held-out loss."""
    with Cluster(2, backend="gloo", timeout=300) as ranks:
        progress("DDP with AdamW")
        curves = {"DDP": ranks.run(_curve, "ddp")[0]}
        for run in runs:
            progress(_name(*run))
            curves[_name(*run)] = ranks.run(_curve, "diloco", *run)[0]
    ddp = curves["DDP"]
    target = ddp[math.ceil(TARGET_AT * len(ddp)) - 1][2]
    rows, base = [], _reached(ddp, target)
    for name, curve in curves.items():
        hit = _reached(curve, target)
        rows.append({"method": name, "target": target,
                     "steps": hit[0] if hit else None, "bytes": hit[1] if hit else None,
                     "vs_ddp": hit[1] / base[1] if hit else None,
                     "final_loss": curve[-1][2], "total_bytes": curve[-1][1],
                     "curve": [(b, loss) for _, b, loss in curve]})
    return rows


def figure(rows: list[dict]):
    """Held-out loss against bytes sent per rank, one line per method; the target dotted."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.8), layout="constrained")
    ax = fig.add_subplot()
    for r in rows:
        ax.plot([b / 2**20 for b, _ in r["curve"]], [loss for _, loss in r["curve"]],
                label=r["method"])
    ax.axhline(rows[0]["target"], color="black", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")  # every point follows at least one message: no zero bytes
    ax.set_yscale("log")
    ax.set_xlabel("MiB sent per rank (metered)")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    return fig


def report(rows: list[dict], out_dir: Path) -> str:
    save_results(rows, figure(rows), out_dir, "diloco",
                 title="DiLoCo (inner AdamW, outer Nesterov) vs DDP with AdamW, 2 CPU ranks:\n"
                       "held-out loss against bytes sent")
    shown = [{"method": r["method"],
              "steps": "never" if r["steps"] is None else str(r["steps"]),
              "bytes": "-" if r["bytes"] is None else f"{r['bytes'] / 2**20:.2f} MiB",
              "vs": "-" if r["vs_ddp"] is None else f"{r['vs_ddp']:.3f}x",
              "final": f"{r['final_loss']:.4f}"} for r in rows]
    return (f"DiLoCo vs DDP, both with AdamW, 2 ranks, float64: bytes each rank sent to reach "
            f"the held-out loss {rows[0]['target']:.4f} (DDP's after {TARGET_AT:.0%} of its "
            f"{STEPS} steps)\n"
            + format_table(shown, [("method", "method"), ("steps", "steps to target"),
                                   ("bytes", "bytes sent"), ("vs", "vs DDP"),
                                   ("final", f"held-out loss at {STEPS}")]))
