"""Lesson 00's exercise check: a loss averaged over ranks that hold different amounts of data."""

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
    return torch.rand(rank + 1, generator=generator, dtype=torch.float64)


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
