"""The tour's trained run: the decoder trained for a few steps on the standard library's
sources with dp=2 and ZeRO-1, in float64, against the same run on one process."""

from __future__ import annotations

import math
import time

from ..demo import Context, Row
from ..runtime import launch
from .config import load_config
from .loop import train

STEPS = 10


def tour(ctx: Context) -> list[Row]:
    """One row: every step's loss of the 2-rank run equals one process's."""
    overrides = {"train.steps": STEPS, "train.eval_every": 0, "train.precision": "fp64",
                 "optim.warmup_steps": 2}
    one = launch(train, 1, load_config("tiny", overrides))[0]
    start = time.perf_counter()
    runs = ctx.cluster(2).run(train, load_config("tiny", {**overrides, "parallel.dp": 2,
                                                          "parallel.zero": 1}))
    seconds = time.perf_counter() - start
    same = all(math.isclose(a, b, rel_tol=1e-10) for run in runs
               for a, b in zip(run.losses, one.losses, strict=True))
    return [Row("a decoder trained on Python's sources, dp=2 + ZeRO-1", 2, same, seconds,
                note=f"float64, every step's loss vs one process; loss {one.losses[0]:.2f} -> "
                     f"{one.losses[-1]:.2f} in {STEPS} steps; minipar train --config tiny")]
