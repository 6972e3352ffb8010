"""The speedup lab's engine: weak scaling of one data-parallel configuration on 1..K real
ranks, beside the ideal and the alpha-beta model of its gradient exchange."""

from __future__ import annotations

import math
import statistics
import time

import torch

from .. import trace
from ..collectives import fit_machine
from ..cost import CommStep
from ..machine import Machine
from ..models import mlp
from ..runtime import Cluster, device, world_size
from .compression import ErrorFeedback, Int8, PowerSGD, TopK
from .ddp import DataParallel

COMPRESSION_CHOICES = ("none", "top-1%", "top-10%", "int8", "powersgd-4")


def _make_compressor(name: str):
    choices = {"top-1%": lambda: TopK(0.01), "top-10%": lambda: TopK(0.1), "int8": Int8,
               "powersgd-4": lambda: PowerSGD(4)}
    if name not in choices:
        raise ValueError(f"compression must be one of {COMPRESSION_CHOICES}; got {name!r}")
    return choices[name]()


def _lab_steps(width: int, per_rank: int, bucket_bytes: int | None, compression: str,
               steps: int) -> float:
    """Median step time on this rank; compute and all-reduce spans go into the Timeline."""

    model = mlp([width, width, width, width], seed=0)  # seed 0 on every rank: equal replicas
    x = torch.randn(per_rank, width, device=device())
    parallel = world_size() > 1
    wrapped = DataParallel(model, bucket_bytes, overlap=True) \
        if parallel and compression == "none" else model
    compressor = _make_compressor(compression) if parallel and compression != "none" else None
    feedback = ErrorFeedback()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        torch.distributed.barrier()  # every rank starts the step together
        start = time.perf_counter()
        with trace.record("compute", "forward+backward", step=step):
            ((wrapped(x) - x) ** 2).mean().backward()
        if compressor is not None:
            with trace.record("all_reduce", "compressed gradients", step=step), torch.no_grad():
                for name, p in model.named_parameters():
                    p.grad.copy_(feedback.average(compressor, p.grad, name))
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_speedup(max_ranks: int, width: int, per_rank: int, bucket_bytes: int | None,
                    compression: str = "none", steps: int = 5) -> list[dict]:
    """Weak scaling (per-rank batch fixed) on 1..max_ranks ranks, measured and modelled.

    Speedup = samples/s on K ranks over samples/s on 1. The model: the 1-rank step
    time (all compute) plus the fitted machine's (`minipar.machine`) ring all-reduce of
    the gradient as sent (compressed size), fitted on 2 ranks of this machine.
    """

    if compression != "none":
        _make_compressor(compression)
    rows = []
    machine = Machine("gloo", 0.0, 0.0, 0.0, 1)  # no communication with one rank
    for k in range(1, max_ranks + 1):
        with Cluster(k, backend="gloo") as cluster:
            if k == 2:
                machine = fit_machine(cluster, save=False, sizes=[4, 4 << 10, 64 << 10,
                                                                  1 << 20, 4 << 20])
            result = cluster.run(_lab_steps, width, per_rank, bucket_bytes, compression, steps)
        measured = [e for e in result.timeline if (e.step or 0) >= 1 or e.kind != "compute"]
        first = min(e.start for e in result.timeline if e.label == "forward+backward"
                    and e.step == 1)
        summary = trace.Timeline(e for e in measured if e.start >= first).summary(k)
        rows.append({"ranks": k, "seconds": max(result),
                     "samples_per_s": k * per_rank / max(result),
                     "compute": sum(summary.busy) / k / steps,
                     "comm": sum(summary.comm) / k / steps,
                     "idle": sum(summary.idle) / k / steps})
    base = rows[0]
    for row in rows:
        k = row["ranks"]
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        comm = _gradient_exchange_seconds(width, compression, k, machine)
        row["model_speedup"] = k * base["seconds"] / (base["seconds"] + comm)
    return rows


def _gradient_exchange_seconds(width: int, compression: str, k: int, machine: Machine) -> float:
    """Modelled time to exchange one step's gradients of the lab's 3-layer MLP.

    Dense and PowerSGD factors are all-reduced (ring); top-k and int8 payloads are
    all-gathered (ring: K-1 steps, each rank forwarding one payload per step).
    """

    shapes = [(width, width), (width,)] * 3
    if compression == "none":
        return machine.all_reduce_seconds("ring", k, sum(math.prod(s) for s in shapes) * 4)
    compressor = _make_compressor(compression)
    total = 0.0
    for shape in shapes:
        payload = compressor.payload_bytes(torch.empty(shape))
        if compression.startswith("powersgd") and len(shape) == 2:
            total += 2 * machine.all_reduce_seconds("ring", k, payload / 2)
        elif compression.startswith("powersgd"):
            total += machine.all_reduce_seconds("ring", k, payload)
        elif k > 1:  # two ring all-gathers (data, index/scale): K-1 steps, every rank busy
            total += 2 * (k - 1) * machine.step_seconds(CommStep(k, payload / 2, k))
    return total


def speedup_in_turns(per_rank_sizes: tuple[int, ...] = (8, 2048), width: int = 256,
                     ranks: int = 2, rounds: int = 5, steps: int = 5) -> list[dict]:
    """Does data parallelism pay? Each per-rank batch's weak-scaling speedup on `ranks`
    ranks over one, measured in turns so that a busy machine slows both sides alike.

    One rank and `ranks` ranks stay alive for the whole run; each round times every
    batch size on both, the side that goes first alternating from round to round.
    Per row: the per-round speedups (samples/s on `ranks` ranks over samples/s on one)
    with their median and range, and the median step times of both sides: the one-rank
    step is all compute, and what the `ranks`-rank step adds is the gradient exchange
    that compute did not hide (`exposed`)."""

    if ranks < 2 or rounds < 1 or not per_rank_sizes:
        raise ValueError(f"speedup_in_turns needs ranks >= 2, rounds >= 1 and at least one "
                         f"batch size; got ranks={ranks}, rounds={rounds}, "
                         f"per_rank_sizes={per_rank_sizes}")
    times: dict[int, dict[str, list[float]]] = {b: {"one": [], "many": []}
                                               for b in per_rank_sizes}
    with Cluster(1, backend="gloo") as one, Cluster(ranks, backend="gloo") as many:
        for round_ in range(rounds):
            for b in per_rank_sizes:
                sides = [("one", one), ("many", many)]
                for side, cluster in sides if round_ % 2 == 0 else sides[::-1]:
                    result = cluster.run(_lab_steps, width, b, 1 << 20, "none", steps)
                    times[b][side].append(max(result))  # the step ends with the slowest rank
    rows = []
    for b in per_rank_sizes:
        one_s, many_s = times[b]["one"], times[b]["many"]
        speedups = [ranks * t1 / tk for t1, tk in zip(one_s, many_s, strict=True)]
        rows.append({"per_rank": b, "ranks": ranks, "speedups": speedups,
                     "median": statistics.median(speedups), "low": min(speedups),
                     "high": max(speedups), "one_rank_step": statistics.median(one_s),
                     "step": statistics.median(many_s),
                     "exposed": statistics.median(many_s) - statistics.median(one_s)})
    return rows
