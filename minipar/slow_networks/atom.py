"""ATOM (Wu, Rao, Chen 2024): swap the model, not the activations.

Each peer holds the whole model in host memory and runs it layer by layer through its
device, which need not hold more than a layer or two: a layer's parameters load for its
forward, leave, load again for its backward, and its gradients go back to the host, the
next layer's load running on the copy stream while this layer computes. That is
`sharded.Offload` with the states on the host and the activations kept: one mechanism,
driven here for the whole model (`SwappedReplica`).

Peers train copies on their own samples and average whole models now and then over the
network, without waiting for the average: CO2's local SGD (`relaxed.co2_local_sgd`: the
average runs in the background while the peer keeps training), or local SGD when the
averages should block (`relaxed.local_sgd`; with one local step it is synchronous data
parallelism). Only model averages cross the network, every `local_steps` steps; a
pipeline (SWARM) sends activations at every micro-batch.

The cost model (`atom_seconds`, `swarm_seconds`, `crossover`) prices a step of each on a
link from its time on an infinitely fast one and the alpha-beta model of what it sends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import collectives
from ..cost import Link, all_reduce_cost
from ..sharded.karma import Compute
from ..sharded.memory_tracker import MemoryTracker
from ..sharded.offload import Offload
from ..sharded.zero import OptimizerFactory
from .relaxed import RelaxedReport, SGDReplica, co2_local_sgd, local_sgd

METHODS = ("co2", "local_sgd")


class SwappedReplica:
    """A whole model in host memory, swapped layer by layer through a device of `budget`
    bytes (None: no limit) that the MemoryTracker enforces at every layer; a LocalReplica for
    local SGD and CO2."""

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, loss_fn: Callable,
                 budget: int | None = None, prefetch: bool = True) -> None:
        # ATOM swaps parameters, gradients and optimizer state; activations stay on the device
        self.offload = Offload(module, optimizer, "keep", states="host", prefetch=prefetch,
                               budget=budget)
        self.loss_fn = loss_fn
        self.tracker: MemoryTracker = self.offload.tracker()

    def local_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        with self.tracker.watch():  # samples as each layer comes in: a budget overrun raises
            loss = self.loss_fn(self.offload(x), y)
            loss.backward()
        self.offload.step()
        return loss.item()

    def vector(self) -> torch.Tensor:
        self.offload.stream.join()
        return torch.cat([layer.host.detach() for layer in self.offload.layers])

    def load_vector(self, flat: torch.Tensor) -> None:
        start = 0
        with torch.no_grad():
            for layer in self.offload.layers:
                layer.evict()  # a load already on the device (or on its way) is stale now
                layer.host.copy_(flat[start:start + layer.host.numel()])
                start += layer.host.numel()
        if self.offload.prefetch:
            self.offload.layers[0].prefetch(self.offload.stream)

    def peak(self) -> int:
        """The most bytes the device held at any sample so far."""
        return self.tracker.peak().total


@dataclass
class AtomReport(RelaxedReport):
    """RelaxedReport plus the bytes this rank sent, seconds per step, and the device peak
    (None without swapping)."""

    sent_bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    peak: int | None = None


class _Timed(Sequence):
    """The batches, timing each step from one request to the next (the training loop asks
    for step i+1's batch when step i is done)."""

    def __init__(self, batches: Sequence, seconds: list[float]) -> None:
        self.batches, self.seconds, self.last = batches, seconds, None

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        batch = self.batches[index]  # past the end: IndexError, the loop is over
        now = time.perf_counter()
        if self.last is not None:
            self.seconds.append(now - self.last)
        self.last = now
        return batch


def train_atom(model_fn: Callable[[], nn.Module], batches: Sequence, loss_fn: Callable,
               lr: float, local_steps: int = 4, method: str = "co2", swap: bool = True,
               budget: int | None = None) -> tuple[AtomReport, torch.Tensor]:
    """Run on every peer: train a copy of `model_fn()` with SGD on this rank's shard of each
    batch, swapped through a device of `budget` bytes (`swap`), averaging whole models every
    `local_steps` steps by `method` ("co2": in the background; "local_sgd": blocking).
    Returns the report and the final parameters (flat)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    model = model_fn()
    replica = SwappedReplica(model, lambda p: torch.optim.SGD(p, lr=lr), loss_fn, budget) \
        if swap else SGDReplica(model, loss_fn, lr)
    run = co2_local_sgd if method == "co2" else local_sgd
    seconds: list[float] = []
    timed = _Timed(batches, seconds)
    with collectives.meter() as m:
        relaxed = run(replica, timed, local_steps)
    seconds.append(time.perf_counter() - timed.last)  # the last step ends with the loop
    report = AtomReport(relaxed.losses, relaxed.rounds, m.sent_bytes, seconds,
                        replica.peak() if swap else None)
    return report, replica.vector()


# --- the cost model: a step on a link, from its time on an infinitely fast one ---

def swap_seconds(layer_flops: Sequence[float], layer_bytes: Sequence[int], compute: Compute,
                 copy: Link) -> float:
    """One swapped step's compute and copies: each layer computes a forward and a backward
    (about three forwards) while its parameters cross the copy link three times (in for
    forward, in for backward, gradients out); prefetch overlaps the two streams, so the
    slower sets the pace, plus the first layer's load that nothing hides."""
    computing = sum(3 * compute.seconds(f) for f in layer_flops)
    copying = sum(3 * copy.seconds(b) for b in layer_bytes)
    return max(computing, copying) + copy.seconds(layer_bytes[0])


def atom_seconds(base: float, model_bytes: int, peers: int, local_steps: int,
                 network: Link) -> float:
    """ATOM's step on `network`: `base` seconds of swapped compute, plus the share of one
    ring all-reduce of the model every `local_steps` steps that CO2 could not hide behind
    the next round's local steps."""
    average = all_reduce_cost("ring", peers, model_bytes, network.alpha, network.beta).seconds
    return base + max(average - local_steps * base, 0.0) / local_steps


@dataclass(frozen=True)
class SwarmTraffic:
    """What minipar's SWARM trainer exchanges with its workers per step: `messages` and
    `nbytes` (all of them on the critical path: the trainer waits on each reply)."""

    messages: int
    nbytes: int


def swarm_traffic(boundary_bytes: Sequence[int], stage_bytes: Sequence[int],
                  microbatches: int, itemsize: int) -> SwarmTraffic:
    """Messages and bytes of one SWARM step (`pipeline.swarm`'s protocol). Per micro-batch
    and stage: a header (4 int64) and the input out, the output and its seconds back; in
    backward a header and the output's gradient out, the input's gradient back. Per stage
    at the step's end: a header and the counted micro-batch ids out, the stage's gradient
    back, a header and the averaged gradient out. `boundary_bytes[s]`: stage s's input
    per global batch (s = 0: the samples), the last entry the model's output."""
    header, messages, nbytes = 4 * 8, 0, 0
    for s, params in enumerate(stage_bytes):
        into, out = boundary_bytes[s], boundary_bytes[s + 1]
        messages += 6 * microbatches + 5
        nbytes += 2 * (header * microbatches + into + out) + microbatches * itemsize
        nbytes += 2 * header + microbatches * 8 + 2 * params
    return SwarmTraffic(messages, nbytes)


def swarm_seconds(base: float, traffic: SwarmTraffic, network: Link) -> float:
    """SWARM's step on `network`: `base` plus every message's latency and bytes."""
    return base + traffic.messages * network.alpha + traffic.nbytes * network.beta


@dataclass(frozen=True)
class Crossover:
    """Where the modelled steps of ATOM and a pipeline (`other`) are equal: `bandwidth`
    (bytes/s; None if they never cross in the range searched) and which one is ahead below
    it."""

    bandwidth: float | None
    atom_ahead_below: bool  # without a crossing: whether ATOM is ahead everywhere
    other: str = "SWARM"

    def __str__(self) -> str:
        ahead, behind = ("ATOM", self.other) if self.atom_ahead_below else (self.other, "ATOM")
        if self.bandwidth is None:
            return f"none: {ahead}'s modelled step is shorter at every bandwidth"
        bits = self.bandwidth * 8
        speed = f"{bits / 1e9:.3g} Gb/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mb/s"
        return f"{speed} ({ahead} ahead below it, {behind} above)"


def crossover(atom: Callable[[Link], float], swarm: Callable[[Link], float],
              latency: float, low: float = 1e3, high: float = 1e13,
              other: str = "SWARM") -> Crossover:
    """The bandwidth (bytes/s, at `latency`) where ATOM's modelled step equals SWARM's (or
    another pipeline's, named `other`), by bisection on a log scale between `low` and
    `high`."""
    def ahead(bandwidth: float) -> bool:
        link = Link(latency, bandwidth)
        return atom(link) < swarm(link)

    below = ahead(low)
    if below == ahead(high):
        return Crossover(None, below, other)
    for _ in range(60):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if ahead(middle) == below else (low, middle)
    return Crossover(math.sqrt(low * high), below, other)
