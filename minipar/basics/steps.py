"""First steps on many ranks: hello world, independent work, and what one slow worker
costs everyone."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..runtime import device, rank, world_size
from ..trace import record


def hello() -> float:
    """Each rank contributes rank+1; after all_reduce every rank holds 1+2+...+K."""
    me, size = rank(), world_size()
    # on this rank's device: under NCCL a collective's tensor must live on the GPU
    value = torch.tensor([me + 1.0], device=device())
    # in place, summing by default: every rank's `value` becomes the total
    dist.all_reduce(value)
    print(f"hello from rank {me} of {size} on {device()}: sum = {value.item():g}")
    return value.item()


def busy_work(units: int, size: int = 96) -> float:
    """Deterministic work on this rank's device: `units` small matrix products; returns a
    checksum."""
    generator = torch.Generator().manual_seed(0)
    # the same seeded draw on any device
    # / sqrt(size): x @ a keeps its scale, so tanh neither saturates nor vanishes
    a = (torch.randn(size, size, generator=generator) / size**0.5).to(device())
    x = torch.eye(size, device=device())
    for _ in range(units):
        # each product depends on the last: the work cannot be skipped or reordered
        x = torch.tanh(x @ a)
    return float(x.sum())


STRAGGLES = ("work", "sleep")


def synchronized_steps(steps: int = 3, units: int = 40, slow_rank: int | None = None,
                       slowdown: float = 2.0, straggle: str = "work") -> float:
    """Data-parallel-style steps: compute, then wait for everyone (an all-reduce).

    Rank `slow_rank` is a straggler, `slowdown` times slower. With straggle="work" it
    does `slowdown` times the work (a longer input): visible when every rank has a core
    of its own, since ranks sharing cores take turns and the extra work hides in the
    time-sharing. With straggle="sleep" it does the same work as the others, then
    sleeps (slowdown - 1) times as long as that took (a slower or busier device): its
    step is `slowdown` times its compute on any number of cores. Every rank records its
    step (work and any sleep) and its wait, so the Timeline shows who idles.
    Returns the sum of all ranks' checksums from the last step.
    """
    if straggle not in STRAGGLES:
        raise ValueError(f"straggle must be one of {', '.join(STRAGGLES)}; got {straggle!r}")
    me = rank()
    slow = me == slow_rank
    my_units = round(units * slowdown) if slow and straggle == "work" else units
    total = torch.zeros(1, dtype=torch.float64, device=device())
    for step in range(steps):
        with record("compute", f"step {step}", step=step):
            start = time.perf_counter()
            total = torch.tensor([busy_work(my_units)], dtype=torch.float64, device=device())
            if slow and straggle == "sleep":
                # sleep, not more work: a sleep costs the same on any number of cores
                time.sleep((slowdown - 1) * (time.perf_counter() - start))
        with record("wait", "all_reduce", step=step):
            # the all-reduce waits for every rank: here the fast ranks pay for the slow one
            dist.all_reduce(total)
    return total.item()
