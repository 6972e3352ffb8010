"""`minipar bench train-dp`: `minipar bench train`'s data-parallel rows alone, in more rounds.

Whether data parallelism reaches 1.8x on 2 cores is a question about a ratio near 2x,
read on machines whose speed moves 10-30% from one minute to the next: in one 3-round run
of `bench train`, the ceiling (two processes of half the batch each, no messages) spread
from 1.25x to 2.24x one process. A median of three such rounds cannot tell 1.7x from 1.8x.

This bench runs only the rows that answer it, the same measurements as `bench train`
(bench.py: each rank on one thread, the rows in turns, ratios per round): one process,
dp=2, the ceiling, dp=2 without its gradient reductions (a stopwatch of stepping
together) and ZeRO-1/2/3. It runs them for `ROUNDS` rounds instead of three (about 7
minutes on 2 cores; `bench train` takes 23). The lines under the table give dp=2 over
the ceiling per round: the cost of the reductions and of waiting for the slower rank,
apart from what two busy processes cost each other; then that gap split in two, stepping
together and the reductions (dp_references.py); the "slower rank" column, how much of a
step the wait takes.
"""

from __future__ import annotations

import functools

from . import bench
from .bench import BASELINE
from .dp_references import CEILING, NO_REDUCTIONS

# the rows that say how close data parallelism comes to 2x, and to what it could reach
ROWS = (BASELINE, "dp=2, fp32", CEILING, NO_REDUCTIONS, "dp=2 zero=1, fp32", "dp=2 zero=2, fp32",
        "dp=2 zero=3, fp32")
ROUNDS = 9  # bench train's 3 left a spread wider than the gap in question


def measure(steps: int = 12, rounds: int = ROUNDS, preset: str = "small") -> list[dict]:
    """`ROWS` of `minipar bench train`, in turns for `rounds` rounds."""
    return bench.measure(steps, rounds, preset, rows=ROWS)


# bench train's table of these rows, its JSON and plot saved as bench_train_dp.json and .png
report = functools.partial(bench.report, name="train_dp")
