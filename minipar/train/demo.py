"""The tour's trained runs: the decoder trained for a few steps on the standard library's
sources, in float64, against the same run on one process: dp=2 with ZeRO-1, and dp=2 x
tp=2 with ZeRO-3 (FSDP over the data-parallel group of a tensor-parallel model,
torchtitan's "2D" layout)."""

from __future__ import annotations

import math
import time

from ..demo import Context, Row
from ..runtime import launch
from .config import load_config
from .loop import train

STEPS = 10

# (what the row says, ranks, the parallel section's overrides)
LAYOUTS = [
    ("a decoder trained on Python's sources, dp=2 + ZeRO-1", 2,
     {"parallel.dp": 2, "parallel.zero": 1}, "--dp 2 --zero 1"),
    ("the same decoder, dp=2 x tp=2 + ZeRO-3 (FSDP over tp)", 4,
     {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3}, "--dp 2 --tp 2 --zero 3"),
]


def tour(ctx: Context) -> list[Row]:
    """A row per layout: every step's loss of the parallel run equals one process's."""
    overrides = {"train.steps": STEPS, "train.eval_every": 0, "train.precision": "fp64",
                 "optim.warmup_steps": 2}
    one = launch(train, 1, load_config("tiny", overrides))[0]
    rows = []
    for title, ranks, parallel, flags in LAYOUTS:
        start = time.perf_counter()
        runs = ctx.cluster(ranks).run(train, load_config("tiny", {**overrides, **parallel}))
        seconds = time.perf_counter() - start
        same = all(math.isclose(a, b, rel_tol=1e-10) for run in runs
                   for a, b in zip(run.losses, one.losses, strict=True))
        rows.append(Row(title, ranks, same, seconds,
                        note=f"float64, every loss = one process's ({one.losses[0]:.2f}"
                             f" -> {one.losses[-1]:.2f}, {STEPS} steps); minipar train "
                             f"--config tiny {flags}"))
    return rows
