"""A parameter server: server ranks hold the weights, worker ranks pull, compute and push.

Ranks 0..S-1 are servers, each holding one slice of the flattened parameters
(torch.tensor_split boundaries); ranks S..K-1 are the W = K - S workers. Every
message goes through minipar's metered send/recv, so the meter shows the traffic: per
step each worker pulls the model and pushes a gradient, and the servers together send
W models and receive W gradients.

- sync: each step every worker pulls, computes on its shard of the global batch
  (loss scaled by `shard_weight`), and pushes; the servers average the W gradients
  and take one SGD step. Step by step this is single-process SGD on the whole batch.
- async (one server, gloo): the server applies each gradient the moment it arrives
  and sends that worker fresh weights. A gradient computed on version v and applied
  at version v' has staleness v' - v; gradients staler than `max_staleness` are
  dropped (the worker just pulls again). Each worker's own loss is a mean over its
  shard, unscaled: its gradient is applied on its own. The server's report says which
  worker each applied and each dropped gradient came from, so a lesson can show whose
  gradients go stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .. import collectives
from ..runtime import rank, world_size
from ..trace import record
from .ddp import shard, shard_weight

MODES = ("sync", "async")


@dataclass
class ServerReport:
    """What one rank saw: its role, and either its updates (server) or its losses (worker)."""

    role: str  # "server" or "worker"
    losses: list[float] = field(default_factory=list)  # worker: its loss each step
    staleness: list[int] = field(default_factory=list)  # server, async: per applied update
    applied_from: list[int] = field(default_factory=list)  # server, async: its worker, per update
    dropped: int = 0  # server, async: gradients too stale to apply
    dropped_from: list[int] = field(default_factory=list)  # server, async: its worker, per drop
    params: torch.Tensor | None = None  # server: its final slice


def _check(model: nn.Module, servers: int, mode: str, max_staleness: int | None) -> int:
    size = world_size()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers < size:
        raise ValueError(f"servers must be an int from 1 to world_size - 1 = {size - 1} (at least "
                         f"one rank must be a worker); got {servers!r}")
    count = sum(p.numel() for p in model.parameters())
    if servers > count:
        raise ValueError(f"servers={servers} but the model has only {count} parameters; use at "
                         f"most {count} servers")
    if mode == "async":
        if servers != 1:
            raise ValueError("async mode runs with servers=1")
        if dist.get_backend() != "gloo":
            raise ValueError("async mode needs backend='gloo' (it receives from whichever "
                             "worker is ready; NCCL cannot)")
    if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
        raise ValueError(f"max_staleness must be None or an int >= 0; got {max_staleness!r}")
    return count


def train_parameter_server(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           lr: float, servers: int = 1, mode: str = "sync",
                           max_staleness: int | None = None,
                           slow_workers: dict[int, float] | None = None) -> ServerReport:
    """Train `model` (built identically on every rank) on `batches` of (x, y), one step per
    batch per worker; call on every rank. `slow_workers` maps a worker rank to extra
    seconds per step (a simulated straggler, to see staleness grow)."""
    count = _check(model, servers, mode, max_staleness)
    # each server's slice: tensor_split's boundaries, computed alike on every rank
    bounds = collectives.split_bounds(count, servers)
    workers = list(range(servers, world_size()))
    me = rank()
    with torch.no_grad():
        flat = parameters_to_vector(model.parameters()).detach().clone()
    if me < servers:
        # clone: the slice is updated in place, and must not keep the whole vector alive
        mine = flat[bounds[me]:bounds[me + 1]].clone()
        if mode == "sync":
            return _sync_server(mine, workers, len(batches), lr)
        return _async_server(flat, workers, len(batches), lr, max_staleness)
    if mode == "sync":
        return _sync_worker(model, flat, bounds, workers, batches, loss_fn, slow_workers or {})
    return _async_worker(model, flat, batches, loss_fn, slow_workers or {})


def _sync_server(mine: torch.Tensor, workers: list[int], steps: int, lr: float) -> ServerReport:
    incoming = torch.empty_like(mine)
    for step in range(steps):
        with record("comm", "pull", step=step):
            for w in workers:
                collectives.send(mine, w)
        total = torch.zeros_like(mine)
        with record("comm", "push", step=step):
            for w in workers:
                total += collectives.recv(incoming, w)
        with record("compute", "update", step=step):
            # / W: the gradients were scaled by shard_weight for an average over the W workers
            mine -= lr * total / len(workers)
    return ServerReport("server", params=mine)


def _load(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        vector_to_parameters(flat, model.parameters())


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
              weight: float) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    loss = loss_fn(model(x), y) * weight
    loss.backward()
    # an unused parameter's gradient is zeros, so the vector always has the full length
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return loss.item(), torch.cat([g.reshape(-1) for g in grads])


def _sync_worker(model: nn.Module, flat: torch.Tensor, bounds: list[int], workers: list[int],
                 batches: Sequence, loss_fn: Callable, slow: dict[int, float]) -> ServerReport:
    report = ServerReport("worker")
    index = workers.index(rank())
    for step, (x, y) in enumerate(batches):
        with record("comm", "pull", step=step):
            for s in range(len(bounds) - 1):
                collectives.recv(flat[bounds[s]:bounds[s + 1]], s)
        _load(model, flat)
        with record("compute", "gradient", step=step):
            lx, ly = shard(x, index, len(workers)), shard(y, index, len(workers))
            loss, grad = _gradient(model, lx, ly, loss_fn,
                                   shard_weight(len(lx), len(x), len(workers)))
            time.sleep(slow.get(rank(), 0.0))
        report.losses.append(loss)
        with record("comm", "push", step=step):
            for s in range(len(bounds) - 1):
                collectives.send(grad[bounds[s]:bounds[s + 1]], s)
    return report


def _async_server(flat: torch.Tensor, workers: list[int], steps: int, lr: float,
                  max_staleness: int | None) -> ServerReport:
    report = ServerReport("server")
    # the version travels as a one-element tensor: send and recv move tensors only
    version = torch.zeros(1, dtype=torch.float64, device=flat.device)
    header, grad = torch.zeros_like(version), torch.empty_like(flat)
    remaining = {w: steps for w in workers}
    for w in workers:
        collectives.send(version, w)
        collectives.send(flat, w)
    while any(remaining.values()):
        src = collectives.recv_any(header)  # whichever worker is ready first
        collectives.recv(grad, src)
        staleness = int(version.item() - header.item())
        if max_staleness is None or staleness <= max_staleness:
            with record("compute", "update", peer=src):
                flat -= lr * grad
            version += 1
            report.staleness.append(staleness)
            report.applied_from.append(src)
        else:
            report.dropped += 1
            report.dropped_from.append(src)
        remaining[src] -= 1
        if remaining[src]:
            # only a worker with steps left is sent weights: it is the one waiting in recv
            collectives.send(version, src)
            collectives.send(flat, src)
    report.params = flat
    return report


def _async_worker(model: nn.Module, flat: torch.Tensor, batches: Sequence, loss_fn: Callable,
                  slow: dict[int, float]) -> ServerReport:
    report = ServerReport("worker")
    version = torch.zeros(1, dtype=torch.float64, device=flat.device)
    workers = world_size() - 1
    index = rank() - 1
    for step, (x, y) in enumerate(batches):
        collectives.recv(version, 0)
        collectives.recv(flat, 0)
        _load(model, flat)
        with record("compute", "gradient", step=step):
            lx, ly = shard(x, index, workers), shard(y, index, workers)
            loss, grad = _gradient(model, lx, ly, loss_fn, 1.0)
            time.sleep(slow.get(rank(), 0.0))
        report.losses.append(loss)
        # the version its gradient was computed at: the server measures staleness from it
        collectives.send(version, 0)
        collectives.send(grad, 0)
    return report
