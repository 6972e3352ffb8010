"""The first-steps demo: hello world (an all-reduce of rank+1), independent work split
over the ranks, and synchronized steps with one slow rank, each checked against one
process. `python -m minipar.basics`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..demo import Check, Context, Row, best_run, combine, one_process, start_clock
from ..plots import render_timeline, to_png
from ..runtime import device, rank, world_size
from .steps import busy_work, hello, synchronized_steps


def _split_work(tasks: int, units: int) -> float:
    """Tasks dealt round-robin over the ranks, the checksums summed by an all-reduce."""
    me, size = rank(), world_size()
    # round-robin (me, me + K, ...): task sizes grow with t, so each rank gets early and late
    # ones; float64 so the sum matches one process's to 1e-9
    local = torch.tensor([sum(busy_work(units + t) for t in range(me, tasks, size))],
                         dtype=torch.float64, device=device())
    dist.all_reduce(local)
    return local.item()


def demo(cases: tuple[str, ...] = ("hello", "split_work"), tasks: int = 16,
         units: int = 100) -> list[Check]:
    """On every rank: hello world, and `tasks` units of work split over the ranks, each
    against what one process computes."""
    k, checks = world_size(), []
    if "hello" in cases:
        start = start_clock()
        total = hello()
        # exact ==: small integers are exact in floating point
        checks.append(Check("hello: all-reduce of rank+1", total == k * (k + 1) / 2,
                            time.perf_counter() - start,
                            note=f"every rank holds {'+'.join(str(r + 1) for r in range(k))}"))
    if "split_work" in cases:
        expected = sum(busy_work(units + t) for t in range(tasks))
        start = start_clock()
        got = _split_work(tasks, units)
        checks.append(Check("independent work split over ranks + all-reduce",
                            math.isclose(got, expected, rel_tol=1e-9),
                            time.perf_counter() - start))
    return checks


def tour(ctx: Context, tasks: int = 16, units: int = 200, steps: int = 3,
         step_units: int = 800) -> list[Row]:
    """Hello on 4 ranks; split work on 2 with its speedup over one process; one slow rank
    of 2, drawn as a Gantt chart."""
    rows = ctx.checks(4, demo, ("hello",))
    _, single = one_process(lambda: sum(busy_work(units + t) for t in range(tasks)))
    (split,) = combine(best_run(ctx.cluster(2), demo, ("split_work",), tasks, units))
    split.speedup, split.note = single / split.seconds, "ceiling 2x on 2 cores"
    rows.append(split)
    # The straggler sleeps rather than computes its extra time: on a shared or 2-core
    # machine, extra work would hide in the time-sharing, a sleep shows on any cores.
    cluster = ctx.cluster(2)
    balanced = best_run(cluster, synchronized_steps, steps, step_units)
    slow = best_run(cluster, synchronized_steps, steps, step_units, slow_rank=1, slowdown=2.0,
                    straggle="sleep")
    reference, single = one_process(
        lambda: [busy_work(step_units) + busy_work(step_units) for _ in range(steps)][-1])
    waited = sum(e.duration for e in slow.timeline.for_rank(0) if e.kind == "wait")
    (ctx.out_dir / "slow_worker.png").write_bytes(to_png(render_timeline(
        slow.timeline, title="one slow rank: rank 1's steps take 2x as long (its work, then "
                             "a sleep as long), rank 0 waits in the all-reduce")))
    slow.timeline.save_chrome(ctx.out_dir / "slow_worker.trace.json")
    rows.append(Row("one slow worker (2x step time), then synchronize", 2,
                    all(math.isclose(r, reference, rel_tol=1e-6) for r in slow), slow.seconds,
                    single / slow.seconds,
                    note=f"{slow.seconds / balanced.seconds:.2f}x the balanced step time; rank 0 "
                         f"waited {waited / slow.timeline.makespan:.0%} of the run"))
    return rows
