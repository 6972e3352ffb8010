"""The sharded data-parallel demo (lesson 06): ZeRO stages 1, 2 and 3 (FSDP) on real ranks
against one process with Adam on whole batches, the same batches on every rank; memory
beyond the device: KARMA's offloading plan on each rank, and ZeRO-Offload.
`python -m minipar.sharded`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import time

import torch
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..data_parallel import shard, shard_weight, task
from ..demo import Check, Context, Row, run_cases, start_clock
from ..models import mse
from . import karma
from .fsdp import FullyShardedDataParallel
from .memory_tracker import MemoryTracker
from .offload import Offload
from .zero import ZeroDataParallel
from .zero_offload import host_optimizer

CASES = ("zero1", "zero2", "zero3", "offload", "zero-offload")


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _one_process() -> tuple[torch.nn.Module, int]:
    """The model after one process's Adam on whole batches, and its device peak."""
    reference = task.model()
    opt = _adam(reference.parameters())
    memory = MemoryTracker(reference, opt)
    for x, y in task.batches():
        opt.zero_grad()
        with memory.watch():
            mse(reference(x), y).backward()
        opt.step()
    return reference, memory.peak().total


def _zero(stage: int, offload: bool = False) -> Check:
    """ZeRO stage 1, 2 or 3 with Adam (on the host with `offload`) against one process with
    Adam on whole batches."""
    reference, _ = _one_process()
    model = task.model()
    adam = host_optimizer(_adam) if offload else _adam
    wrapped = FullyShardedDataParallel(model, adam) if stage == 3 else \
        ZeroDataParallel(model, adam, stage=stage, bucket_bytes=64 << 10)
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
    if offload:
        return Check("ZeRO-Offload: ZeRO-2's optimizer step on the host", same, seconds,
                     m.sent_bytes, note="Adam's state and step on host copies of the slices")
    return Check(label, same, seconds, m.sent_bytes,
                 note="Adam, float64; memory per rank: minipar bench zero")


def _offload() -> Check:
    """KARMA's plan, parameters and Adam on the host, against one process in memory (each
    rank trains alone: offloading is one device's matter)."""
    reference, in_memory = _one_process()
    model = task.model()
    x = task.batches()[0][0]
    layers = karma.profile(model, x)
    plan = karma.plan(layers, karma.fit_copy(repeats=1), karma.fit_compute(model, x, 1),
                      sum(p.saved_bytes for p in layers) // 2)
    off = Offload(model, _adam, plan.choices, states="host")
    tracker = off.tracker()
    start = start_clock()
    for x, y in task.batches():
        with tracker.watch():
            mse(off(x), y).backward()
        off.step()
    seconds = time.perf_counter() - start
    off.gather_parameters()
    same = torch.equal(parameters_to_vector(model.parameters()),
                       parameters_to_vector(reference.parameters()))
    return Check("Offload: states on the host, KARMA's swap/recompute plan", same, seconds,
                 note=f"plan {' '.join(plan.choices)}; device peak {tracker.peak().total:,} B "
                      f"vs {in_memory:,} B in memory; exact")


def demo(cases: tuple[str, ...] = CASES) -> list[Check]:
    """On every rank: each named ZeRO stage ("zero1", "zero2", "zero3"), KARMA's offloading
    ("offload") and ZeRO-Offload ("zero-offload")."""
    runs = {f"zero{stage}": (lambda stage=stage: _zero(stage)) for stage in (1, 2, 3)}
    runs.update({"offload": _offload, "zero-offload": lambda: _zero(2, offload=True)})
    return run_cases(runs, cases)


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo, CASES)
