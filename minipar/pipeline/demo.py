"""The pipeline demo: every synchronous schedule on real ranks, each rank checking its
stages' gradients (and the last stage the loss) against one process running the whole
model. `python -m minipar.pipeline`, `minipar tour` and the tests all run `demo`."""

from __future__ import annotations

import math
import time

import torch

from .. import collectives
from ..data_parallel import single_process_sgd
from ..demo import Check, Context, Row, combine, skip, start_clock
from ..models import linear_stack, mlp, mse, regression_data
from ..runtime import RankDied, launch, world_size
from .engine import Pipeline, split_model
from .schedules import SCHEDULES, schedule
from .simulate import simulate
from .skippipe import one_process_paths, plan_paths, skip_model, train_paths
from .swarm import swarm

CASES = (("gpipe", 8, 1), ("1f1b", 8, 1), ("zb_h1", 8, 1), ("interleaved_1f1b", 8, 2),
         ("looped_bfs", 8, 2), ("zb_v", 8, 2), ("dualpipev", 8, 2))
WIDTH, BATCH = 64, 64


def _case(name: str, microbatches: int, virtual: int) -> Check:
    k = world_size()
    title = f"pipeline {name} (m={microbatches}{f', v={virtual}' if virtual > 1 else ''})"
    try:
        plan = schedule(name, k, microbatches, virtual)
    except ValueError as impossible:  # e.g. interleaved 1F1B with 8 micro-batches on 3 ranks
        fits = [str(p) for p in range(1, 9) if SCHEDULES[name].fits(p, microbatches, virtual)]
        return skip(title, f"impossible on {k} ranks: {impossible}; it runs with --ranks "
                           f"{', '.join(fits)}")
    stages = k * virtual
    x, y = regression_data(BATCH, WIDTH, outputs=WIDTH, seed=9, dtype=torch.float64)
    pipe = Pipeline(split_model(linear_stack(WIDTH, stages, dtype=torch.float64), stages), plan)
    start = start_clock()
    with collectives.meter() as m:
        loss = pipe.train_step(x, y, mse)
    seconds = time.perf_counter() - start
    reference = split_model(linear_stack(WIDTH, stages, dtype=torch.float64), stages)
    ref_loss = mse(torch.nn.Sequential(*reference)(x), y)
    ref_loss.backward()
    same = all(torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12)
               for s, mod in pipe.modules.items()
               for p, q in zip(mod.parameters(), reference[s].parameters(), strict=True))
    if loss is not None:
        same = same and math.isclose(loss, ref_loss.item(), rel_tol=1e-10)
    ideal = simulate(plan, {"F": 1, "B": 2, "I": 1, "W": 1}).summary(k).bubble_fraction
    return Check(title, same, seconds, m.sent_bytes, note=f"ideal bubble {ideal:.2f}")


def demo(cases: tuple[tuple[str, int, int], ...] = CASES) -> list[Check]:
    """On every rank: train one step of each (schedule, micro-batches, virtual) case."""
    return [_case(*case) for case in cases]


def _batches(steps: int, features: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_data(steps * 16, features, seed=5, dtype=torch.float64)
    return list(zip(x.split(16), y.split(16), strict=True))


def _swarm_model() -> torch.nn.Sequential:
    return mlp([8, 32, 32, 1], seed=5, dtype=torch.float64)


def _swarm_row() -> Row:
    """Driver side, fresh processes (a death ends a run's group): SWARM on pools of 2,
    rank 4 SIGKILLed at its first request of step 1, against one process."""
    batches, pools = _batches(4, 8), [[1, 2], [3, 4]]
    start = time.perf_counter()
    # by step: a death at the n-th forward may never come to a worker measured slow
    run = launch(swarm, 5, _swarm_model, pools, batches, mse, 0.1, 4, kill_at_step={4: 1},
                 tolerate_deaths=True)
    seconds = time.perf_counter() - start
    reference = _swarm_model()
    single_process_sgd(reference, batches, mse, 0.1)  # the micro-batches' mean loss
    halves = [torch.nn.utils.parameters_to_vector(h.parameters()) for h in
              split_model(reference, 2)]
    same = isinstance(run[4], RankDied) and all(
        torch.allclose(run[w], halves[s], rtol=1e-10) for s, pool in enumerate(pools)
        for w in pool if w != 4)
    return Row("SWARM: pools of 2 per stage, a worker killed", 5, same, seconds,
               note=f"rank 4 SIGKILLed; {run[0].resent} micro-batch(es) sent again; "
                    "survivors vs one process")


def _skippipe_row(ctx: Context) -> Row:
    """SkipPipe on 5 stages, each micro-batch skipping one middle stage."""
    steps = _batches(3, 4)
    plans = [plan_paths(5, 4, skip=1, speeds=[1.0, 1.0, 0.25, 1.0, 1.0])] * len(steps)
    start = time.perf_counter()
    run = ctx.cluster(5).run(train_paths, lambda: skip_model(4, 16, 5), steps, plans, mse,
                             0.1)
    seconds = time.perf_counter() - start
    reference = skip_model(4, 16, 5)
    losses = one_process_paths(reference, steps, plans, mse, 0.1)
    same = all(math.isclose(a, b, rel_tol=1e-10) for a, b in zip(run[-1][0], losses,
                                                                  strict=True))
    same = same and all(torch.allclose(p, torch.nn.utils.parameters_to_vector(
        reference[r].parameters()), rtol=1e-10) for r, (_, p) in enumerate(run))
    visits = sum(2 in path for path in plans[0])
    return Row("SkipPipe: paths skip and reorder middle stages", 5, same, seconds,
               note=f"slow stage 2 on {visits} of {len(plans[0])} paths; vs the same paths "
                    "on one process")


def tour(ctx: Context) -> list[Row]:
    """The tour's pipeline rows, each with a Chrome trace of the real run."""
    rows = []
    for case, ranks in ((("gpipe", 8, 1), 2), (("1f1b", 8, 1), 4),
                        (("interleaved_1f1b", 8, 2), 2), (("zb_h1", 8, 1), 2)):
        cluster = ctx.cluster(ranks)
        cluster.run(demo, (case,))  # gloo connects each pair of ranks on first use
        run = cluster.run(demo, (case,))
        trace_name = f"pipeline_{case[0]}.trace.json"
        run.timeline.save_chrome(ctx.out_dir / trace_name)
        (row,) = combine(run)
        row.note += f"; trace: {trace_name}"
        rows.append(row)
    return rows + [_swarm_row(), _skippipe_row(ctx)]
