"""The data-parallel demo: each trainer on real ranks against one process (SGD; Adam for
the ZeRO stages) on the same batches (computed on every rank), and the relaxed and
compressed trainers, which are not exact by design, with their loss going down. `python
-m minipar.data_parallel`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..demo import Check, Context, Row, skip, start_clock
from ..models import mlp, regression_data
from ..runtime import RankError, launch, rank, world_size
from .checkpoint import train_resumable
from .compression import TopK, train_compressed
from .ddp import DataParallel, shard, shard_weight, single_process_sgd
from .fsdp import FullyShardedDataParallel
from .gossip import train_gossip
from .parameter_server import train_parameter_server
from .relaxed import train_relaxed
from .zero import ZeroDataParallel

CASES = ("all_reduce", "zero1", "zero2", "zero3", "parameter_server", "local_sgd", "co2",
         "hogwild", "top_k", "sgp_complete", "sgp", "grouped")
STEPS, BATCH, LR = 4, 64, 0.05


def _batches(steps: int = STEPS, dtype: torch.dtype = torch.float64) -> list:
    x, y = regression_data(steps * BATCH, 32, seed=7, dtype=dtype)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return mlp([32, 256, 256, 1], seed=7, dtype=dtype)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _same(params: torch.Tensor, reference: torch.Tensor) -> bool:
    return torch.allclose(params, reference, rtol=1e-9, atol=1e-12)


def _all_reduce_trainer() -> Check:
    ref_losses, ref_params = single_process_sgd(_model(), _batches(), _mse, LR)
    model = _model()
    ddp = DataParallel(model, bucket_bytes=64 << 10, overlap=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    start = start_clock()
    with collectives.meter() as m:
        for x, y in _batches():
            lx, ly = shard(x), shard(y)
            loss = _mse(ddp(lx), ly) * shard_weight(len(lx), len(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size())
    seconds = time.perf_counter() - start
    same = _same(parameters_to_vector(model.parameters()).detach(), ref_params) and all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip(losses, ref_losses, strict=True))
    return Check("data parallel: bucketed all-reduce, overlapped", same, seconds, m.sent_bytes,
                 note="every step, float64; speedups: minipar bench data-parallel")


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _zero(stage: int) -> Check:
    """ZeRO stage 1, 2 or 3 with Adam against one process with Adam on whole batches."""
    reference = _model()
    opt = _adam(reference.parameters())
    for x, y in _batches():
        opt.zero_grad()
        _mse(reference(x), y).backward()
        opt.step()
    model = _model()
    wrapped = FullyShardedDataParallel(model, _adam) if stage == 3 else \
        ZeroDataParallel(model, _adam, stage=stage, bucket_bytes=64 << 10)
    start = start_clock()
    with collectives.meter() as m:
        for x, y in _batches():
            lx, ly = shard(x), shard(y)
            (_mse(wrapped(lx), ly) * shard_weight(len(lx), len(x))).backward()
            wrapped.step()
    seconds = time.perf_counter() - start
    if stage == 3:
        wrapped.gather_parameters()
    same = _same(parameters_to_vector(model.parameters()).detach(),
                 parameters_to_vector(reference.parameters()).detach())
    label = {1: "ZeRO-1: optimizer state sharded", 2: "ZeRO-2: + gradients sharded",
             3: "ZeRO-3 / FSDP: + parameters sharded"}[stage]
    return Check(label, same, seconds, m.sent_bytes,
                 note="Adam, float64; memory per rank: minipar bench zero")


def _parameter_server() -> Check:
    if world_size() < 2:
        return skip("parameter server, sync", "needs a server and at least one worker; it "
                                              "runs with --ranks 2 or more")
    _, ref_params = single_process_sgd(_model(), _batches(), _mse, LR)
    start = start_clock()
    with collectives.meter() as m:
        report = train_parameter_server(_model(), _batches(), _mse, LR)
    same = _same(report.params, ref_params) if report.role == "server" else None
    workers = f"{world_size() - 1} worker{'s' if world_size() > 2 else ''}"
    return Check(f"parameter server, sync (1 server, {workers})", same,
                 time.perf_counter() - start, m.sent_bytes,
                 note="server's weights vs single-process SGD")


def _local_sgd() -> Check:
    _, ref_params = single_process_sgd(_model(), _batches(), _mse, LR)
    start = start_clock()
    _, params = train_relaxed("local_sgd", _model, _batches(), _mse, LR, local_steps=1)
    return Check("local SGD, H=1 (average every step)", _same(params, ref_params),
                 time.perf_counter() - start, note="H=1 is synchronous SGD")


def _shared_file() -> str:
    """A path every rank maps for Hogwild!: rank 0 picks it, the others are told."""
    path = [tempfile.mkstemp(prefix="minipar-hogwild-")[1] if rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


def _relaxed(method: str) -> Check:
    dtype = torch.float32 if method == "hogwild" else torch.float64
    kwargs = {"shared_file": _shared_file()} if method == "hogwild" else {"local_steps": 4}
    start = start_clock()
    report, _ = train_relaxed(method, lambda: _model(dtype), _batches(24, dtype), _mse, LR,
                              **kwargs)
    seconds = time.perf_counter() - start
    if method == "hogwild":
        dist.barrier()  # every rank is done with the shared file
        if rank() == 0:
            os.remove(kwargs["shared_file"])
    label = {"co2": "CO2-style local SGD, H=4, async average",
             "hogwild": "Hogwild!, lock-free shared memory"}[method]
    return Check(label, None, seconds, note=f"not exact by design; loss {report.losses[0]:.3f} "
                                            f"-> {report.losses[-1]:.3f}")


def _top_k() -> Check:
    batches = _batches(24)
    start = start_clock()
    report = train_compressed(_model(), batches, _mse, LR, TopK(0.05))
    share = sum(report.payload_bytes) / (len(batches) * report.dense_bytes)
    return Check("data parallel, top-5% gradients + error feedback", None,
                 time.perf_counter() - start,
                 note=f"payload {share:.0%} of dense; loss {report.losses[0]:.3f} -> "
                      f"{report.losses[-1]:.3f}")


def _gossip(case: str) -> Check:
    """SGP on the complete graph (exact), on the exponential graph, and grouped pairs."""
    method, options, label = {
        "sgp_complete": ("sgp", {"graph": "complete"}, "SGP, complete graph (exact average)"),
        "sgp": ("sgp", {}, "SGP, exponential graph, one push a step"),
        "grouped": ("grouped", {"group_size": 2, "swap_every": 2},
                    "grouped all-reduce, pairs swapped every 2 steps")}[case]
    batches = _batches(4 if case == "sgp_complete" else 24)
    start = start_clock()
    report, params = train_gossip(method, _model, batches, _mse, LR, **options)
    seconds = time.perf_counter() - start
    if case == "sgp_complete":
        return Check(label, _same(params, single_process_sgd(_model(), batches, _mse, LR)[1]),
                     seconds, sum(report.sent_bytes), note="one push to everyone = all-reduce")
    return Check(label, None, seconds, sum(report.sent_bytes),
                 note=f"not exact by design; loss {report.losses[0]:.3f} -> "
                      f"{report.losses[-1]:.3f}, consensus distance {report.consensus[-1]:.1e}")


def _killed_and_resumed(ctx: Context) -> Row:
    """Driver side: 4 ranks, rank 2 SIGKILLed at step 5, resumed on 3 ranks, against an
    uninterrupted 3-rank run (fresh processes: a death ends a run's group)."""
    with tempfile.TemporaryDirectory(prefix="minipar-checkpoint-") as folder, \
            tempfile.TemporaryDirectory(prefix="minipar-checkpoint-") as fresh_folder:
        start = time.perf_counter()
        try:
            launch(train_resumable, 4, _model, _batches(8), _mse, LR, folder, 2, kill_at=(2, 5))
            died = False
        except RankError:
            died = True
        resumed = launch(train_resumable, 3, _model, _batches(8), _mse, LR, folder, 2)
        seconds = time.perf_counter() - start
        fresh = launch(train_resumable, 3, _model, _batches(8), _mse, LR, fresh_folder, 2)
    same = died and all(_same(a[1], b[1]) for a, b in zip(resumed, fresh, strict=True))
    return Row("checkpoint, rank 2 killed, resumed on 3 of 4 ranks", 4, same, seconds,
               note=f"SIGKILL at step 5; resumed from step {8 - len(resumed[0][0])} (the last "
                    "checkpoint); final weights vs an uninterrupted 3-rank run")


RUNS = {"all_reduce": _all_reduce_trainer, "zero1": lambda: _zero(1),
        "zero2": lambda: _zero(2), "zero3": lambda: _zero(3),
        "parameter_server": _parameter_server,
        "local_sgd": _local_sgd, "co2": lambda: _relaxed("co2"),
        "hogwild": lambda: _relaxed("hogwild"), "top_k": _top_k,
        **{case: (lambda case=case: _gossip(case)) for case in ("sgp_complete", "sgp",
                                                                 "grouped")}}


def demo(cases: tuple[str, ...] = CASES) -> list[Check]:
    """On every rank: run each named trainer (see RUNS) on the same small regression task."""
    unknown = [c for c in cases if c not in RUNS]
    if unknown:
        raise ValueError(f"cases must be among {', '.join(RUNS)}; got {unknown}")
    return [RUNS[case]() for case in cases]


def tour(ctx: Context) -> list[Row]:
    return (ctx.checks(2, demo, ("all_reduce", "zero1", "zero2", "zero3"))
            + ctx.checks(4, demo, ("parameter_server",))
            + ctx.checks(2, demo, ("local_sgd", "co2", "hogwild", "top_k"))
            + ctx.checks(4, demo, ("sgp_complete", "sgp", "grouped"))
            + [_killed_and_resumed(ctx)])
