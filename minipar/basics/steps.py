"""First steps on many ranks: hello world, independent work, and what one slow worker
costs everyone."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import device, rank, world_size
from ..trace import record


def hello() -> float:
    """Each rank contributes rank+1; after all_reduce every rank holds 1+2+...+K."""
    me, size = rank(), world_size()
    value = torch.tensor([me + 1.0], device=device())
    dist.all_reduce(value)
    print(f"hello from rank {me} of {size} on {device()}: sum = {value.item():g}")
    return value.item()


def busy_work(units: int, size: int = 96) -> float:
    """Deterministic CPU work: `units` small matrix products; returns a checksum."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator) / size**0.5
    x = torch.eye(size)
    for _ in range(units):
        x = torch.tanh(x @ a)
    return float(x.sum())


def synchronized_steps(steps: int = 3, units: int = 40, slow_rank: int | None = None,
                       slowdown: float = 2.0) -> float:
    """Data-parallel-style steps: compute, then wait for everyone (an all-reduce).

    Rank `slow_rank` does `slowdown` times the work, as a straggler would. Every
    rank records its compute and its wait, so the Timeline shows who idles.
    Returns the sum of all ranks' checksums from the last step.
    """
    me = rank()
    my_units = round(units * slowdown) if me == slow_rank else units
    total = torch.zeros(1, dtype=torch.float64)
    for step in range(steps):
        with record("compute", f"step {step}", step=step):
            total = torch.tensor([busy_work(my_units)], dtype=torch.float64)
        with record("wait", "all_reduce", step=step):
            dist.all_reduce(total)
    return total.item()
