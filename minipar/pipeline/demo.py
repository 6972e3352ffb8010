"""The pipeline demo: every synchronous schedule on real ranks, each rank checking its
stages' gradients (and the last stage the loss) against one process running the whole
model. `python -m minipar.pipeline`, `minipar tour` and the tests all run `demo`."""

from __future__ import annotations

import math
import time

import torch

from .. import collectives
from ..demo import Check, Context, Row, combine
from ..models import linear_stack, regression_data
from ..runtime import world_size
from .engine import Pipeline, split_model
from .schedules import schedule
from .simulate import simulate

CASES = (("gpipe", 8, 1), ("1f1b", 8, 1), ("zb_h1", 8, 1), ("interleaved_1f1b", 8, 2),
         ("looped_bfs", 8, 2))
WIDTH, BATCH = 64, 64


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _case(name: str, microbatches: int, virtual: int) -> Check:
    k = world_size()
    title = f"pipeline {name} (m={microbatches}{f', v={virtual}' if virtual > 1 else ''})"
    if name == "interleaved_1f1b" and microbatches % k:
        return Check(title, None, 0.0, note=f"skipped: {name} needs micro-batches "
                                            f"({microbatches}) divisible by ranks ({k})")
    stages = k * virtual
    x, y = regression_data(BATCH, WIDTH, outputs=WIDTH, seed=9, dtype=torch.float64)
    plan = schedule(name, k, microbatches, virtual)
    pipe = Pipeline(split_model(linear_stack(WIDTH, stages, dtype=torch.float64), stages), plan)
    start = time.perf_counter()
    with collectives.meter() as m:
        loss = pipe.train_step(x, y, _mse)
    seconds = time.perf_counter() - start
    reference = split_model(linear_stack(WIDTH, stages, dtype=torch.float64), stages)
    ref_loss = _mse(torch.nn.Sequential(*reference)(x), y)
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
    return rows
