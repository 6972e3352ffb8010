"""The data-parallel demo (lesson 02): all-reduce data parallelism and a parameter server
on real ranks against one process (SGD) on the same batches (computed on every rank).
`python -m minipar.data_parallel`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..demo import Check, Context, Row, run_cases, skip, start_clock
from ..models import mse
from ..runtime import world_size
from . import task
from .ddp import DataParallel, shard, shard_weight, single_process_sgd
from .parameter_server import train_parameter_server

CASES = ("all_reduce", "parameter_server")


def _all_reduce_trainer() -> Check:
    ref_losses, ref_params = single_process_sgd(task.model(), task.batches(), mse, task.LR)
    model = task.model()
    ddp = DataParallel(model, bucket_bytes=64 << 10, overlap=True)
    opt = torch.optim.SGD(model.parameters(), lr=task.LR)
    losses = []
    start = start_clock()
    with collectives.meter() as m:
        for x, y in task.batches():
            lx, ly = shard(x), shard(y)
            loss = mse(ddp(lx), ly) * shard_weight(len(lx), len(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size())
    seconds = time.perf_counter() - start
    same = task.same(parameters_to_vector(model.parameters()).detach(), ref_params) and all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip(losses, ref_losses, strict=True))
    return Check("data parallel: bucketed all-reduce, overlapped", same, seconds, m.sent_bytes,
                 note="every step, float64; speedups: minipar bench data-parallel")


def _parameter_server() -> Check:
    if world_size() < 2:
        return skip("parameter server, sync", "needs a server and at least one worker; it "
                                              "runs with --ranks 2 or more")
    _, ref_params = single_process_sgd(task.model(), task.batches(), mse, task.LR)
    start = start_clock()
    with collectives.meter() as m:
        report = train_parameter_server(task.model(), task.batches(), mse, task.LR)
    same = task.same(report.params, ref_params) if report.role == "server" else None
    workers = f"{world_size() - 1} worker{'s' if world_size() > 2 else ''}"
    return Check(f"parameter server, sync (1 server, {workers})", same,
                 time.perf_counter() - start, m.sent_bytes,
                 note="server's weights vs single-process SGD")


RUNS = {"all_reduce": _all_reduce_trainer, "parameter_server": _parameter_server}


def demo(cases: tuple[str, ...] = CASES) -> list[Check]:
    """On every rank: run each named trainer (see RUNS) on the same small regression task."""
    return run_cases(RUNS, cases)


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo, ("all_reduce",)) + ctx.checks(4, demo, ("parameter_server",))
