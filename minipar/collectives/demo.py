"""The collectives demo: every all-reduce algorithm against the sum one process computes,
with each rank's metered traffic and torch's own gloo/NCCL all-reduce for scale.
`python -m minipar.collectives`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..demo import Check, Context, Row, start_clock
from ..runtime import device, rank, world_size
from .all_reduce import ALL_REDUCE_ALGORITHMS, all_reduce
from .comm import meter


def rank_data(r: int, numel: int) -> torch.Tensor:
    """Rank r's tensor: random integers in float64, so every order of summing is exact."""
    generator = torch.Generator().manual_seed(1000 + r)
    # drawn on the host: the same data for a rank on any device
    return torch.randint(-1000, 1000, (numel,), generator=generator).to(torch.float64)


def _timed_all_reduce(algorithm: str, numel: int) -> tuple[torch.Tensor, int, float]:
    tensor = rank_data(rank(), numel).to(device())
    start = start_clock()
    with meter() as m:
        if algorithm == "torch":
            dist.all_reduce(tensor)
        else:
            all_reduce(tensor, algorithm=algorithm)
    return tensor, m.sent_bytes, time.perf_counter() - start


def demo(numel: int = 1 << 19, repeats: int = 3) -> list[Check]:
    """On every rank: torch's own all-reduce, then each of minipar's algorithms (best of
    `repeats`), against the sum of all ranks' tensors, which every rank can compute alone
    (the data is seeded by rank)."""
    expected = sum(rank_data(r, numel) for r in range(world_size()))
    size = f"{numel * 8 >> 20} MiB" if numel * 8 >= 1 << 20 else f"{numel * 8 >> 10} KiB"
    checks = []
    for algorithm in ("torch", *ALL_REDUCE_ALGORITHMS):
        runs = [_timed_all_reduce(algorithm, numel) for _ in range(repeats)]
        result, sent, seconds = min(runs, key=lambda run: run[2])
        if algorithm == "torch":
            name, sent = f"all-reduce, torch's {dist.get_backend()} built-in ({size})", None
        else:
            name = f"all-reduce, {algorithm} (minipar, {size})"
        checks.append(Check(name, torch.equal(result.cpu(), expected), seconds, sent))
    return checks


def tour(ctx: Context) -> list[Row]:
    """Every algorithm on 4 ranks, its time beside torch's (the slowest rank of each)."""
    builtin, *rows = ctx.checks(4, demo)
    for row in rows:
        row.note = f"{builtin.seconds / row.seconds:.2f}x torch's all_reduce"
    return [builtin, *rows]
