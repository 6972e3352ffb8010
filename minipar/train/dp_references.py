"""What `minipar bench train` and `train-dp` hold dp=2 against, to say where its gap to
2x goes.

dp=2 on 2 cores cannot beat two processes that each train half the batch at once and
never talk (`CEILING`): same rows, same cores, no messages, no waiting. Between that
ceiling and dp=2 lie two costs, and one more row tells them apart:

- `NO_REDUCTIONS` is dp=2 with its gradient all-reduces skipped: every bucket's reduction
  returns at once, so each replica steps on its own gradients (the replicas drift apart;
  the row is a stopwatch, never a training run). What is left of data parallelism is
  stepping together: once a step, after backward, one small all-reduce agrees on the loss
  and the gradient norm, and there the faster rank waits for the slower.
- `NO_REDUCTIONS` against the ceiling is what stepping together leaves: the faster rank
  waiting for the slower, step after step (the "slower rank" column measures that wait),
  and whatever else two ranks that keep in step cost each other on shared cores;
- dp=2 against `NO_REDUCTIONS` is what the reductions leave: their CPU on cores that are
  already full, and the last bucket's reduction, which backward cannot hide.

Round by round the two ratios multiply to dp=2 against the ceiling; their medians, taken
over the rounds one by one, need not. No choice of buckets, overlap or communication
thread can take dp=2 past `NO_REDUCTIONS`, which reduces nothing; only an optimizer that
does not step together (local SGD, DiLoCo: lesson 10) can.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..data_parallel import DataParallel
from ..report import ratio_cell

# dp=2 with free reductions and no rank waiting for the other: two one-process runs of half
# the batch each, at once
CEILING = "2 processes, half batch each, no messages"
# dp=2 stepping together but reducing nothing (its gradient all-reduces skipped)
NO_REDUCTIONS = "dp=2, no gradient reductions (a stopwatch)"
DP2 = "dp=2, fp32"  # bench.VARIANTS' name of the row both are held against


@contextmanager
def gradient_reductions_skipped() -> Iterator[list[int]]:
    """Inside, DataParallel's bucket all-reduce (the trainer's dp=2, zero=0) does nothing;
    yields a one-item list that counts the buckets it skipped. The buckets still go through
    the communication thread, so the row keeps dp=2's hand-offs and loses only the
    reductions. The class's own method comes back on exit, on an error too: the bench's
    ranks run the next row in the same process."""
    skipped = [0]
    original = DataParallel._all_reduce

    def skip(self: DataParallel, bucket: object) -> None:  # ddp.py's _Bucket
        skipped[0] += 1

    DataParallel._all_reduce = skip
    try:
        yield skipped
    finally:
        DataParallel._all_reduce = original


def _per_round(top: dict, bottom: dict) -> list[float]:
    """`top`'s tokens/s over `bottom`'s, round by round (both were divided by the same
    round's one process, which cancels)."""
    return [a / b for a, b in zip(top["vs_one_process"], bottom["vs_one_process"], strict=True)]


def against_references(rows: list[dict]) -> list[str]:
    """The lines under the table: dp=2 over the ceiling, round by round (its reductions and
    its stepping together at once), with the slower rank's lead; and, with the
    `NO_REDUCTIONS` row, that gap in its two parts. None of these ratios can pass 1 but by
    noise, and a median that does says so (`ratio_cell`)."""
    by_name = {r["variant"]: r for r in rows}
    dp, ceiling, stopwatch = (by_name.get(n) for n in (DP2, CEILING, NO_REDUCTIONS))
    lines = []
    if dp and ceiling:
        lead = dp["slower_rank_lead_s"]
        lines.append(
            f"dp=2 against the ceiling (two processes, no messages), per round: "
            f"{ratio_cell(_per_round(dp, ceiling), ceiling=1.0)}; in its median round dp=2's "
            f"slower rank computed {lead * 1e3:.0f} ms a step longer than the ranks' mean "
            f"({lead / dp['step_s']:.0%} of its step), a wait no message causes")
    parts = []
    if stopwatch and ceiling:
        parts.append(f"dp=2 without its gradient reductions (a stopwatch: the ranks still meet "
                     f"once a step) against the ceiling, per round: "
                     f"{ratio_cell(_per_round(stopwatch, ceiling), ceiling=1.0)}, what "
                     "stepping together leaves")
    if stopwatch and dp:
        parts.append(f"dp=2 against {'it' if parts else 'the stopwatch'}: "
                     f"{ratio_cell(_per_round(dp, stopwatch), ceiling=1.0)}, what its "
                     "reductions leave")
    if parts:
        lines.append("; ".join(parts) + (" (per round the two multiply to dp=2 against the "
                                         "ceiling; their medians need not)"
                                         if len(parts) == 2 else ""))
    return lines
