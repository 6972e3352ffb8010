"""Fit a `minipar.machine.Machine` by measurement: a ping-pong through minipar's own
send and receive (alpha, beta, one transfer alone), a ring shift with every rank busy
(the same under contention) and a timed addition (gamma), a few seconds in all."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from .. import trace
from ..cost import fit_alpha_beta
from ..machine import Machine
from ..runtime import Cluster, cpu_cores, device, rank
from .comm import _Comm, validation
from .p2p import recv, send

PINGPONG_SIZES = [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def reduce_seconds_per_byte(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """gamma: seconds per byte for an in-place add, on one thread."""
    # float32: 4 bytes an element
    a, b = (torch.zeros(nbytes // 4, device=device()), torch.ones(nbytes // 4, device=device()))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)  # the minimum: the least disturbed run
    return best / nbytes


def pingpong(sizes: list[int], repeats: int = 5) -> list[float]:
    """One-way seconds (half the median round trip) for each message size between ranks 0
    and 1, through minipar's send and recv as its collectives use them (no handshake, no
    tracing); other ranks stay idle."""
    return _timed(sizes, repeats, _pingpong_once, halve=True)


def ring_shift(sizes: list[int], repeats: int = 5) -> list[float]:
    """Seconds (median, slowest rank) per step in which every rank sends `size` bytes to
    its right neighbour and receives as many from its left: a ring all-reduce's step,
    every rank busy at once, timed over 2(K-1) steps in a row as a ring runs them (ranks
    that share cores wake each other up step after step)."""
    steps = 2 * (dist.get_world_size() - 1)
    mine = [t / steps for t in _timed(sizes, repeats, _shift_once)]
    everyone = [torch.zeros(len(sizes), dtype=torch.float64, device=device())
                for _ in range(dist.get_world_size())]
    # a step takes as long as its slowest rank: every rank gets the per-size maximum
    dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64, device=device()))
    return torch.stack(everyone).max(dim=0).values.tolist()


def _pingpong_once(buffer: torch.Tensor, spare: torch.Tensor) -> None:
    if rank() == 0:
        send(buffer, 1)
        recv(buffer, 1)
    elif rank() == 1:
        recv(buffer, 0)
        send(buffer, 0)


def _shift_once(buffer: torch.Tensor, spare: torch.Tensor) -> None:
    k, me = dist.get_world_size(), rank()
    comm = _Comm("ring_shift", None)
    for _ in range(2 * (k - 1)):
        comm.exchange("shift", sends=[(buffer, (me + 1) % k, None)],
                      recvs=[(spare, (me - 1) % k, None)])


def _timed(sizes: list[int], repeats: int, once, halve: bool = False) -> list[float]:
    seconds = []
    previous = trace.set_recording(False)
    with validation(False):
        for nbytes in sizes:
            # float32 elements; at least one, so the 4-byte size still sends a message
            buffer = torch.zeros(max(nbytes // 4, 1), device=device())
            spare = torch.zeros_like(buffer)
            times = []
            # small messages are bimodal on shared cores: time more of them; the largest
            # are steady and take the longest, so fewer do
            count = 8 * repeats if nbytes <= 256 << 10 else 3 * repeats if nbytes <= 1 << 20 \
                else repeats if nbytes <= 16 << 20 else max(3, repeats // 2)
            for _ in range(count + 1):
                dist.barrier()  # every rank starts the repetition together
                start = time.perf_counter()
                once(buffer, spare)
                times.append(time.perf_counter() - start)
            # times[0] was the warm-up; a round trip is two one-way trips
            seconds.append(statistics.median(times[1:]) / (2 if halve else 1))
    trace.set_recording(previous)
    return seconds


def fit_machine(cluster: Cluster | None = None, backend: str = "auto", save: bool = True,
                sizes: list[int] = PINGPONG_SIZES) -> Machine:
    """Measure this machine and save the result (`Machine.save`) so every model can
    `Machine.load()` it: alpha and beta from a ping-pong between ranks 0 and 1 of `cluster`
    (or of 2 fresh ranks), the same from a ring shift with all of its ranks busy, and gamma
    from additions on one rank. Takes a few seconds."""
    if cluster is None:
        with Cluster(2, backend=backend) as fresh:
            return fit_machine(fresh, save=save, sizes=sizes)
    alpha, beta = fit_alpha_beta(sizes, cluster.run(pingpong, sizes)[0])
    busy_alpha, busy_beta = fit_alpha_beta(sizes, cluster.run(ring_shift, sizes)[0])
    gamma = cluster.run(reduce_seconds_per_byte)[0]
    machine = Machine(cluster.backend, alpha, beta, gamma, cluster.run(cpu_cores)[0],
                      busy_ranks=cluster.world_size, busy_alpha=busy_alpha, busy_beta=busy_beta)
    if save:
        machine.save()
    return machine
