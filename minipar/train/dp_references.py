"""What `minipar bench train` holds dp=2 against, to say where its gap to 2x goes.

dp=2 on 2 cores cannot beat two processes that each train half the batch at once and
never talk (`CEILING`): same rows, same cores, no messages, no waiting. Between that
ceiling and dp=2 lie two costs, and one more row tells them apart:

- `LOCKSTEP` is dp=2 with its gradient all-reduces skipped: every bucket's reduction
  returns at once, so each replica steps on its own gradients (the replicas drift apart;
  the row is a stopwatch, never a training run). What is left of data parallelism is the
  lockstep: the step's one small all-reduce that agrees on the loss and the gradient norm,
  after which neither rank starts its next step before the slower one ends this one.
- `LOCKSTEP` against the ceiling is what stepping together costs: the faster rank
  waiting for the slower, step after step (the "slower rank" column measures that wait),
  and whatever else two ranks that keep in step cost each other on shared cores;
- dp=2 against `LOCKSTEP` is what the reductions cost: their CPU on cores that are
  already full, and the last bucket's reduction, which backward cannot hide.

No choice of buckets, overlap or communication thread can take dp=2 past `LOCKSTEP`,
which does none of that work; only an optimizer that does not step together (local SGD,
DiLoCo: lesson 10) can.
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
LOCKSTEP = "dp=2, no gradient reductions (a stopwatch)"
DP = "dp=2, fp32"


@contextmanager
def gradient_reductions_skipped() -> Iterator[list[int]]:
    """Inside, DataParallel's bucket all-reduce (the trainer's dp=2, zero=0) does nothing;
    yields a one-item list that counts the buckets it skipped. The class's own method comes
    back on exit: the bench's ranks run the next row in the same process."""
    skipped = [0]
    original = DataParallel._all_reduce

    def skip(self: DataParallel, bucket) -> None:
        skipped[0] += 1

    DataParallel._all_reduce = skip
    try:
        yield skipped
    finally:
        DataParallel._all_reduce = original


def _per_round(top: dict, bottom: dict) -> list[float]:
    return [a / b for a, b in zip(top["vs_one_process"], bottom["vs_one_process"], strict=True)]


def against_references(rows: list[dict]) -> list[str]:
    """The lines under the table: dp=2 over the ceiling, round by round (its reductions and
    its waiting together), with the slower rank's lead; and, with the `LOCKSTEP` row,
    the ceiling's gap split into stepping together and the reductions."""
    by_name = {r["variant"]: r for r in rows}
    lines = []
    if DP in by_name and CEILING in by_name:
        dp, lead = by_name[DP], by_name[DP]["slower_rank_lead_s"]
        lines.append(
            f"dp=2 against the ceiling (two processes, no messages), per round: "
            f"{ratio_cell(_per_round(dp, by_name[CEILING]))}; in its median round dp=2's "
            f"slower rank computed {lead * 1e3:.0f} ms a step longer than the ranks' mean "
            f"({lead / dp['step_s']:.0%} of its step), a wait no message causes")
    if LOCKSTEP in by_name and CEILING in by_name:
        lockstep = by_name[LOCKSTEP]
        line = (f"dp=2 without its gradient reductions (stepping together, nothing reduced) "
                f"against the ceiling, per round: "
                f"{ratio_cell(_per_round(lockstep, by_name[CEILING]))}, what stepping "
                "together costs")
        if DP in by_name:
            line += (f"; dp=2 against it: {ratio_cell(_per_round(by_name[DP], lockstep))}, "
                     "what the reductions cost")
        lines.append(line)
    return lines
