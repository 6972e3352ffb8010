"""Lesson 00's exercise checks: a loss averaged over ranks that hold different amounts of
data, and each rank's rows of the global batch."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks

TOLERANCE = 1e-6  # relative: float32 arithmetic (about 7 digits) is a right answer too


def _local_losses(rank: int) -> torch.Tensor:
    """Rank r holds r+1 per-sample losses: the shards are deliberately uneven."""
    # a seed per rank: the checker rebuilds any rank's shard without asking it
    generator = torch.Generator().manual_seed(100 + rank)
    # a CPU generator draws on the host: moved just below
    losses = torch.rand(rank + 1, generator=generator, dtype=torch.float64)
    return losses.to(runtime.device())


def _call_global_mean(fn: Callable) -> float:
    return float(fn(_local_losses(runtime.rank())))


def check_global_mean_loss(global_mean_loss: Callable, world_size: int = 4) -> str:
    """Run `global_mean_loss(local_losses)` on `world_size` ranks with uneven shards.

    Every rank must return the mean over all samples of all ranks, the number one
    process would compute on the whole batch.
    """
    refuse_library("global_mean_loss", global_mean_loss)
    got = run_on_ranks("global_mean_loss", _call_global_mean, world_size, global_mean_loss)
    shards = [_local_losses(r) for r in range(world_size)]
    everything = torch.cat(shards)
    expected = float(everything.mean())
    hints = {
        "the mean of the ranks' means: ranks hold different numbers of samples, so weight "
        "each rank by its count (all-reduce the sum and the count)":
            float(torch.stack([s.mean() for s in shards]).mean()),
        "the sum over all samples: divide by the total number of samples":
            float(everything.sum()),
    }
    for rank, value in enumerate(got):
        if math.isclose(value, expected, rel_tol=TOLERANCE, abs_tol=1e-12):
            continue
        why = next((hint for hint, v in hints.items()
                    if math.isclose(value, v, rel_tol=TOLERANCE)), None)
        if why is None and math.isclose(value, float(shards[rank].mean()), rel_tol=TOLERANCE):
            why = "this rank's own mean: combine the ranks with dist.all_reduce"
        raise ExerciseError(
            f"global_mean_loss: rank {rank} returned {value:.9g}, expected {expected:.9g} "
            f"(the mean of all {everything.numel()} samples)."
            + (f" {value:.9g} is {why}." if why else ""))
    return (f"global_mean_loss: correct on all {world_size} ranks "
            f"({expected:.6f} = mean of {everything.numel()} samples)")


# global batches the check splits: uneven over 4 ranks, fewer rows than ranks, even
BATCHES = (10, 3, 16)


def _call_my_rows(fn: Callable) -> list:
    return [fn(rows, runtime.rank(), runtime.world_size()) for rows in BATCHES]


def expected_rows(rows: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s rows of a global batch of `rows`, cut as the trainer cuts it (the
    package's convention, `data_parallel.shard`): contiguous, the first rows % world_size
    ranks one row more."""
    mine = torch.tensor_split(torch.arange(rows), world_size)[rank]
    return range(int(mine[0]), int(mine[0]) + len(mine)) if len(mine) else range(0)


def _rows_hint(rows: int, got: list[list[int]], world_size: int) -> str:
    """What the usual mistakes look like from the outside: rows nobody holds (n // K
    each), rows held twice or past the end (ceil(n / K) each), the remainder piled on one
    rank, or a rank's rows not in one contiguous run."""
    base, extra = divmod(rows, world_size)
    seen: dict[int, int] = {}
    for rank, mine in enumerate(got):
        for row in mine:
            if not 0 <= row < rows:
                return (f"rank {rank} holds row {row}, but a batch of {rows} has rows 0 to "
                        f"{rows - 1}: ceil({rows} / {world_size}) rows per rank runs past the "
                        "end; give one extra row only to the first rows % world_size ranks")
            if row in seen:
                return (f"row {row} is on rank {seen[row]} and on rank {rank}: every row must "
                        "be computed exactly once, or its gradient counts twice")
            seen[row] = rank
    missing = sorted(set(range(rows)) - set(seen))
    if missing:
        return (f"rows {missing} are on no rank: {rows} // {world_size} = {base} rows each "
                f"leaves {extra} over, and they belong to the first {extra} ranks, one each")
    sizes = [len(mine) for mine in got]
    if max(sizes) - min(sizes) > 1:
        big, small = sizes.index(max(sizes)), sizes.index(min(sizes))
        return (f"rank {big} holds {max(sizes)} rows and rank {small} {min(sizes)}: the "
                "slowest rank sets the step, so sizes may differ by at most one")
    for rank, mine in enumerate(got):
        if mine and mine != list(range(mine[0], mine[0] + len(mine))):
            return (f"rank {rank} holds rows {mine}: keep each rank's rows one contiguous run, "
                    "in order (a slice of the batch, as torch.tensor_split cuts it)")
    return ("every row is held once and the sizes are balanced, but not as torch.tensor_split "
            "cuts the batch: rank 0 first, the ranks with an extra row first")


def grade_rows(got: list[list], world_size: int) -> str:
    """Grade every rank's answers (`got[rank][case]`, one per batch of BATCHES): the
    ExerciseError names the batch, the first wrong rank and the mistake it looks like."""
    for case, rows in enumerate(BATCHES):
        answers = []
        for rank in range(world_size):
            value = got[rank][case]
            try:
                answers.append([int(row) for row in value])
            except TypeError:
                raise ExerciseError(f"my_rows: rank {rank} returned {value!r} for a batch of "
                                    f"{rows} rows; return its row indices, for example "
                                    "range(start, stop)") from None
        want = [list(expected_rows(rows, r, world_size)) for r in range(world_size)]
        if answers != want:
            rank = next(r for r in range(world_size) if answers[r] != want[r])
            raise ExerciseError(
                f"my_rows: batch of {rows} rows on {world_size} ranks: rank {rank} returned "
                f"{answers[rank]}, expected {want[rank]}; "
                f"{_rows_hint(rows, answers, world_size)}.")
    return (f"my_rows: correct on all {world_size} ranks for global batches of "
            f"{', '.join(map(str, BATCHES))} rows")


def check_my_rows(my_rows: Callable, world_size: int = 4) -> str:
    """Run `my_rows(rows, rank, world_size)` on `world_size` ranks for global batches of
    10, 3 and 16 rows; every rank must return its rows as the trainer's sampler cuts them
    (`expected_rows`)."""
    refuse_library("my_rows", my_rows)
    return grade_rows(run_on_ranks("my_rows", _call_my_rows, world_size, my_rows), world_size)
