"""The elastic path: data parallelism under torchrun that survives a killed worker.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        -m minipar.data_parallel.elastic --dir CKPT --kill-at 1:5

On the first attempt rank 1 kills itself (SIGKILL) at step 5. torchrun's agent sees
the worker die, stops the others and starts every worker again; the new workers find
the checkpoint in CKPT (`checkpoint.py`) and finish from there. Rank 0 prints the
steps it ran and writes the final parameters to CKPT/final.pt.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..models import mlp, regression_data
from ..runtime import launch, rank
from .checkpoint import train_resumable

BATCH, FEATURES = 20, 8  # 20 rows: 5 per rank on 4, uneven on 3


def model() -> torch.nn.Module:
    """The small regression MLP the fault-tolerance and network-lab runs train (float64)."""
    return mlp([FEATURES, 16, 1], seed=0, dtype=torch.float64)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of the regression task."""
    x, y = regression_data(steps * BATCH, FEATURES, seed=1, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minipar.data_parallel.elastic",
        description="Data-parallel SGD that checkpoints every few steps and resumes from the "
                    "latest checkpoint; run it under torchrun with --max-restarts.")
    parser.add_argument("--dir", required=True, help="checkpoint folder (kept across restarts)")
    parser.add_argument("--steps", type=int, default=8, help="training steps in all")
    parser.add_argument("--every", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--kill-at", default=None, metavar="RANK:STEP",
                        help="on the first attempt only, RANK kills itself at STEP")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        parser.error("run me under torchrun (see the module docstring), which sets WORLD_SIZE")
    kill = None
    if args.kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        victim, step = (int(v) for v in args.kill_at.split(":"))
        kill = (victim, step)
    size = int(os.environ["WORLD_SIZE"])
    results = launch(train_resumable, size, model, batches(args.steps), mse, 0.05, args.dir,
                     args.every, kill_at=kill)
    if rank() == 0:
        losses, params = results[0]
        torch.save(params, Path(args.dir) / "final.pt")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        last = f"final loss {losses[-1]:.4f}" if losses else "nothing left to run"
        print(f"attempt {int(restart) + 1}: ran {len(losses)} steps, {last}", flush=True)


if __name__ == "__main__":
    main()
