"""The sharded data-parallel demo (lesson 06): ZeRO stages 1, 2 and 3 (FSDP) on real ranks
against one process with Adam on whole batches, the same batches on every rank.
`python -m minipar.sharded`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import time

import torch
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..data_parallel import shard, shard_weight, task
from ..demo import Check, Context, Row, run_cases, start_clock
from ..models import mse
from .fsdp import FullyShardedDataParallel
from .zero import ZeroDataParallel

CASES = ("zero1", "zero2", "zero3")


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _zero(stage: int) -> Check:
    """ZeRO stage 1, 2 or 3 with Adam against one process with Adam on whole batches."""
    reference = task.model()
    opt = _adam(reference.parameters())
    for x, y in task.batches():
        opt.zero_grad()
        mse(reference(x), y).backward()
        opt.step()
    model = task.model()
    wrapped = FullyShardedDataParallel(model, _adam) if stage == 3 else \
        ZeroDataParallel(model, _adam, stage=stage, bucket_bytes=64 << 10)
    start = start_clock()
    with collectives.meter() as m:
        for x, y in task.batches():
            lx, ly = shard(x), shard(y)
            (mse(wrapped(lx), ly) * shard_weight(len(lx), len(x))).backward()
            wrapped.step()
    seconds = time.perf_counter() - start
    if stage == 3:
        wrapped.gather_parameters()
    same = task.same(parameters_to_vector(model.parameters()).detach(),
                 parameters_to_vector(reference.parameters()).detach())
    label = {1: "ZeRO-1: optimizer state sharded", 2: "ZeRO-2: + gradients sharded",
             3: "ZeRO-3 / FSDP: + parameters sharded"}[stage]
    return Check(label, same, seconds, m.sent_bytes,
                 note="Adam, float64; memory per rank: minipar bench zero")


def demo(cases: tuple[str, ...] = CASES) -> list[Check]:
    """On every rank: each named ZeRO stage ("zero1", "zero2", "zero3")."""
    return run_cases({case: (lambda stage=int(case[-1]): _zero(stage)) for case in CASES},
                     cases)


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo, CASES)
