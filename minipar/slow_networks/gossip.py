"""Averaging with a few neighbours instead of everyone: decentralized data parallelism.

- `sgp`: stochastic gradient push (Assran et al. 2019). Each rank keeps a numerator x
  and a push-sum weight w; its model is z = x / w. A step takes a gradient at z and
  subtracts it from x, then every rank keeps a share of (x, w) and pushes equal shares
  to its out-peers, and adds up what it receives. On the directed exponential graph a
  rank sends to one peer per step, 2^0, 2^1, ... hops away in turn: one message per
  step instead of an all-reduce. The weights w make the average right even when a
  rank's in- and out-degrees differ (here they stay 1: every rank receives as many
  shares as it sends); on the complete graph one push is the exact average.
- `grouped`: grouped all-reduce with group swapping (after WAGMA-SGD, Li et al. 2021):
  every step averages the parameters inside small groups, and every `swap_every`
  steps the groups change, along a butterfly, so that after log_g(K) swaps every rank
  has mixed with every other. With one group of all ranks it is synchronous SGD.

Both are exact averaging in the limit of their graph and approximate every step; the
consensus distance (mean squared distance of the ranks' models from their average)
measures how far apart the ranks are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .. import collectives
from ..data_parallel import shard
from ..runtime import new_groups, rank, world_size
from ..trace import record
from .relaxed import RelaxedReport

GRAPHS = ("exponential", "complete")


@dataclass
class GossipReport(RelaxedReport):
    """RelaxedReport plus, per step, the consensus distance, the bytes this rank sent and
    the step's wall-clock seconds."""

    consensus: list[float] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def out_peers(me: int, size: int, step: int, graph: str = "exponential") -> list[int]:
    """Whom rank `me` pushes to at `step`: one peer 2^(step mod log2 K) hops ahead on the
    exponential graph, every other rank on the complete one."""
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}; got {graph!r}")
    if size == 1:
        return []
    if graph == "complete":
        return [(me + hop) % size for hop in range(1, size)]
    # SGP's directed exponential graph: peers 1, 2, 4, ... hops ahead, one per step in turn
    hops = max(1, math.ceil(math.log2(size)))
    return [(me + 2 ** (step % hops)) % size]


def push_sum(x: torch.Tensor, w: float, peers: list[int], sources: list[int],
             survive: bool = False) -> tuple[torch.Tensor, float]:
    """One push-sum gossip step: keep 1/(d+1) of (x, w), send 1/(d+1) to each of the d
    `peers`, add what arrives from `sources`. Returns the new (x, w). With `survive`, a
    peer that has died (its connection closed) is skipped: the share meant for it stays
    here, and nothing arrives from it."""
    share = 1.0 / (len(peers) + 1)
    # w rides as the last element: x and its weight travel in one message
    message = torch.cat([x * share, x.new_tensor([w * share])])
    incoming = [torch.empty_like(message) for _ in sources]
    # default arguments bind b, s (d below) now: plain closures would all see the last ones
    pending = [_attempt(lambda b=b, s=s: collectives.irecv(b, s), survive)
               for b, s in zip(incoming, sources, strict=True)]
    sends = [_attempt(lambda d=d: collectives.isend(message, d), survive) for d in peers]
    # the share we keep: a clone, as message itself is still being sent
    total = message.clone()
    for request in pending:
        if request is not None and _attempt(request.wait, survive) is not None:
            total += request.tensor
    for request in sends:
        if request is None or _attempt(request.wait, survive, done=True) is None:
            total += message  # the dead peer's share stays here: no mass is lost
    return total[:-1], float(total[-1])


def _attempt(call: Callable, survive: bool, done: bool = False):
    """call(); with `survive`, a dead peer's error (gloo: connection closed) gives None."""
    try:
        result = call()
        return True if done else result
    except RuntimeError:
        if not survive:
            raise
        return None


def consensus_distance(z: torch.Tensor) -> float:
    """Mean over ranks of ||z_rank - mean z||^2. A measurement, not part of the algorithm:
    torch's own all-reduce, so no meter counts it and no emulated link slows it."""
    # dist.all_reduce works in place: reduce a copy, not the caller's z
    mean = z.clone()
    dist.all_reduce(mean)
    mean /= world_size()
    # float64: the measurement keeps full precision whatever the model's dtype
    gap = torch.tensor([float((z - mean).pow(2).sum())], dtype=torch.float64, device=z.device)
    dist.all_reduce(gap)
    return float(gap) / world_size()


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
              step: int) -> tuple[float, torch.Tensor]:
    with record("compute", "gradient", step=step):
        model.zero_grad()
        loss = loss_fn(model(shard(x)), shard(y))
        loss.backward()
    return loss.item(), parameters_to_vector(p.grad for p in model.parameters())


def sgp(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable, lr: float, graph: str = "exponential", survive: bool = False,
        measure: bool = True) -> GossipReport:
    """Stochastic gradient push on this rank's shard of every batch (see the module).
    `survive`: go on past dead peers (push_sum); `measure=False` skips the consensus
    distance, a global all-reduce that a dead rank would block."""
    me, size = rank(), world_size()
    report = GossipReport()
    # push-sum starts with weight 1 on every rank, so z = x / w is the model itself
    x, w = parameters_to_vector(model.parameters()).detach().clone(), 1.0
    for step, (xb, yb) in enumerate(batches):
        start = time.perf_counter()
        loss, grad = _gradient(model, xb, yb, loss_fn, step)
        report.losses.append(loss)
        peers = out_peers(me, size, step, graph)
        # in-peers follow from everyone's out-peers: every rank computes the same graph, no message
        sources = [r for r in range(size) if me in out_peers(r, size, step, graph)]
        with collectives.meter() as m, record("comm", "push-sum", step=step):
            x, w = push_sum(x - lr * grad, w, peers, sources, survive)
        with torch.no_grad():
            vector_to_parameters(x / w, model.parameters())  # de-bias: the model is z = x / w
        report.rounds += 1
        report.sent_bytes.append(m.sent_bytes)
        report.seconds.append(time.perf_counter() - start)
        if measure:
            report.consensus.append(consensus_distance(x / w))
    return report


def butterfly_groups(size: int, group_size: int) -> list[list[list[int]]]:
    """Partitions of range(size) into groups of `group_size`, one per phase: in phase t
    a group is the ranks whose base-`group_size` digits differ only in digit t."""
    # round: math.log(125, 5) is 3.0000000000000004; the check below catches non-powers
    levels = round(math.log(size, group_size)) if group_size > 1 else 0
    if group_size < 2 or group_size ** levels != size:
        raise ValueError(f"group_size must be >= 2 with world size a power of it "
                         f"(group_size ** n == {size}); got group_size={group_size}")
    phases = []
    for t in range(levels):
        stride = group_size ** t
        starts = [r for r in range(size) if (r // stride) % group_size == 0]
        phases.append([[s + j * stride for j in range(group_size)] for s in starts])
    return phases


def grouped(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
            loss_fn: Callable, lr: float, group_size: int = 2, swap_every: int = 1,
            survive: bool = False, measure: bool = True) -> GossipReport:
    """SGD whose parameters are averaged inside groups every step; the groups move to the
    next butterfly phase every `swap_every` steps. `measure` as for `sgp`;
    `survive` (pairs only: a bigger group's survivors would wait on each other): a rank
    whose partner has died keeps its own parameters that step."""
    if survive and group_size != 2:
        raise ValueError(f"survive needs group_size=2 (a pair's survivor can go on alone); "
                         f"got group_size={group_size}")
    if isinstance(swap_every, bool) or not isinstance(swap_every, int) or swap_every < 1:
        raise ValueError(f"swap_every must be an int >= 1 (steps between group swaps); "
                         f"got {swap_every!r}")
    size = world_size()
    phases = butterfly_groups(size, group_size) if group_size < size else [[list(range(size))]]
    mine = [new_groups(partition) for partition in phases]  # every rank is in one per phase
    report = GossipReport()
    for step, (xb, yb) in enumerate(batches):
        start = time.perf_counter()
        loss, grad = _gradient(model, xb, yb, loss_fn, step)
        report.losses.append(loss)
        group = mine[(step // swap_every) % len(mine)]
        with collectives.meter() as m, record("all_reduce", "group average", step=step):
            updated = parameters_to_vector(model.parameters()).detach() - lr * grad
            flat = _attempt(lambda u=updated, g=group: collectives.all_reduce(
                # clone: the fallback below needs `updated` as it was if the partner is dead
                u.clone(), op="avg", group=g), survive)
            flat = updated if flat is None else flat  # a dead partner: go on alone
        with torch.no_grad():
            vector_to_parameters(flat, model.parameters())
        report.rounds += 1
        report.sent_bytes.append(m.sent_bytes)
        report.seconds.append(time.perf_counter() - start)
        if measure:
            report.consensus.append(consensus_distance(flat))
    return report


def train_gossip(method: str, model_fn: Callable[[], nn.Module], batches: Sequence,
                 loss_fn: Callable, lr: float, **options) -> tuple[GossipReport, torch.Tensor]:
    """Run "sgp" (options: graph) or "grouped" (group_size, swap_every) on this rank;
    return its report and final parameters (z = x / w for SGP)."""
    methods = {"sgp": sgp, "grouped": grouped}
    if method not in methods:
        raise ValueError(f"method must be one of {tuple(methods)}; got {method!r}")
    model = model_fn()
    report = methods[method](model, batches, loss_fn, lr, **options)
    with torch.no_grad():
        return report, parameters_to_vector(model.parameters()).detach().clone()
