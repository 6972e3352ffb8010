"""SWARM parallelism (Ryabinin et al. 2023): a pipeline whose stages are served by pools
of unreliable workers of uneven speed.

Rank 0 is the trainer: it holds the data and the loss, and routes every micro-batch
through the stages. Each stage is served by a pool of ranks, each holding a whole
replica of that stage. A micro-batch goes to one worker of each pool, picked at random
with probability proportional to the worker's measured throughput (SWARM's stochastic
wiring): a fast worker gets more micro-batches, a slow one fewer, and the workers of a
pool compute theirs at the same time.

A worker that dies takes with it what it held: the activations of its micro-batches
and the gradients it accumulated for them. The trainer notices (a message to or from it
fails), drops it from its pool, and sends those micro-batches through again on the
survivors, so every micro-batch counts exactly once and a step with a death makes the
same update as one without (tested against one process). At the end of a step each
worker returns the summed gradient of its micro-batches that counted; the trainer
averages per pool and sends the mean back, and every worker of the pool takes the same
SGD step, so replicas stay equal. (SWARM averages inside a pool by all-reduce among its
peers; the trainer does it here, a parameter-server shortcut that keeps the code small.)
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..runtime import device, rank
from ..trace import record
from .engine import split_model

FORWARD, BACKWARD, GRADS, UPDATE, STOP = range(1, 6)


@dataclass
class SwarmReport:
    """The trainer's account: loss and seconds per step, micro-batches each worker served
    per step, deaths as (step, rank), and micro-batches sent through again."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    served: list[dict[int, int]] = field(default_factory=list)
    deaths: list[tuple[int, int]] = field(default_factory=list)
    resent: int = 0


def pick(weights: dict[int, float], rng: random.Random) -> int:
    """A worker at random, with probability proportional to its weight (throughput)."""
    workers = sorted(weights)
    return rng.choices(workers, [weights[w] for w in workers])[0]


def _send(op: int, mb: int, dst: int, payload: torch.Tensor | None = None) -> list:
    rows, cols = (payload.shape[0], payload.shape[1]) if payload is not None and \
        payload.dim() == 2 else (0 if payload is None else payload.numel(), 0)
    pending = [collectives.isend(torch.tensor([op, mb, rows, cols], device=device()), dst)]
    if payload is not None:
        pending.append(collectives.isend(payload.contiguous(), dst))
    return pending


def _worker(module: nn.Module, lr: float, slowdown: float, kill_at_step: int | None) -> None:
    """Serve the trainer's requests until STOP (or die at the first request of step
    `kill_at_step`)."""
    params = list(module.parameters())
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    grads: dict[int, torch.Tensor] = {}
    updates = 0  # every step ends with an UPDATE to every worker: a step count
    while True:
        header = torch.zeros(4, dtype=torch.int64, device=device())
        op, mb, rows, cols = collectives.recv(header, 0).tolist()
        if kill_at_step is not None and updates >= kill_at_step and op != STOP:
            # by step, not by forwards: how many forwards a worker serves depends on its
            # measured speed, so on the machine's load; the steps it sees do not
            os.kill(os.getpid(), signal.SIGKILL)
        dtype = params[0].dtype
        if op == FORWARD:
            x = collectives.recv(torch.zeros(rows, cols, dtype=dtype, device=device()), 0)
            start = time.perf_counter()
            with record("compute", f"F{mb}", microbatch=mb):
                x.requires_grad_()
                y = module(x)
                time.sleep((slowdown - 1) * (time.perf_counter() - start))
            saved[mb] = (x, y)
            seconds = torch.tensor([time.perf_counter() - start], dtype=dtype, device=device())
            collectives.send(torch.cat([y.detach().flatten(), seconds]), 0)
        elif op == BACKWARD:
            g = collectives.recv(torch.zeros(rows, cols, dtype=dtype, device=device()), 0)
            x, y = saved.pop(mb)
            with record("compute", f"B{mb}", microbatch=mb):
                dx, *dp = torch.autograd.grad(y, [x, *params], g)
            grads[mb] = parameters_to_vector(dp)
            collectives.send(dx, 0)
        elif op == GRADS:
            ids = torch.zeros(rows, dtype=torch.int64, device=device())
            ids = collectives.recv(ids, 0).tolist()
            total = sum((grads[i] for i in ids), torch.zeros_like(grads[ids[0]])) if ids \
                else parameters_to_vector(params).detach() * 0
            collectives.send(total, 0)
        elif op == UPDATE:
            updates += 1
            mean = collectives.recv(torch.zeros(rows, dtype=dtype, device=device()), 0)
            with torch.no_grad():
                flat = parameters_to_vector(params) - lr * mean
                torch.nn.utils.vector_to_parameters(flat, params)
            grads.clear()
            saved.clear()  # activations of micro-batches that did not count
        elif op == STOP:
            return


class _Trainer:
    """Rank 0's side: the routing, the deaths noticed, the per-pool averages."""

    def __init__(self, pools: list[list[int]], stages: list[nn.Module], seed: int) -> None:
        self.pools = pools
        self.out_features = [_out_features(m) for m in stages]
        self.sizes = [sum(p.numel() for p in m.parameters()) for m in stages]
        self.dtype = next(stages[0].parameters()).dtype
        self.speed = {w: 1.0 for pool in pools for w in pool}
        self.dead: set[int] = set()
        self.rng = random.Random(seed)
        self.report = SwarmReport()

    def _died(self, worker: int, step: int) -> None:
        if worker not in self.dead:
            self.dead.add(worker)
            self.report.deaths.append((step, worker))

    def _alive(self, stage: int) -> dict[int, float]:
        alive = {w: self.speed[w] for w in self.pools[stage] if w not in self.dead}
        if not alive:
            raise RuntimeError(f"every worker of stage {stage} died; the swarm cannot go on")
        return alive

    def intact(self, mbs: dict, route: dict[int, list[int]]) -> dict:
        """The micro-batches of `mbs` none of whose workers has died."""
        return {mb: v for mb, v in mbs.items() if all(w not in self.dead for w in route[mb])}

    def post(self, op: int, mb: int, worker: int, step: int,
             payload: torch.Tensor | None = None) -> list | None:
        """Start sending a request to `worker`; None (the worker marked dead) if it has
        gone, which gloo may say as soon as the send is posted."""
        if worker in self.dead:
            return None
        try:
            return _send(op, mb, worker, payload)
        except RuntimeError:
            self._died(worker, step)
            return None

    def deliver(self, op: int, mb: int, worker: int, step: int,
                payload: torch.Tensor | None = None) -> bool:
        """Send a request and wait until it has left; False if the worker has gone."""
        return self._wait(self.post(op, mb, worker, step, payload), worker, step)

    def fetch(self, shape: tuple[int, ...], worker: int, step: int) -> torch.Tensor | None:
        """Receive a reply of `shape` from `worker`; None (the worker marked dead) if it
        has gone."""
        try:
            return collectives.recv(torch.zeros(shape, dtype=self.dtype, device=device()), worker)
        except RuntimeError:
            self._died(worker, step)
            return None

    def _wait(self, pending: list | None, worker: int, step: int) -> bool:
        if pending is None:
            return False
        try:
            for request in pending:
                request.wait()
            return True
        except RuntimeError:
            self._died(worker, step)
            return False

    def wave(self, todo: dict[int, tuple], step: int, loss_fn: Callable, served: dict,
             route: dict[int, list[int]]) -> dict[int, float]:
        """Every micro-batch in `todo` (mb -> (x, y)) through every stage and back; returns
        the losses of those that made it (their workers alive at the end of the wave)."""
        acts = {mb: x for mb, (x, _) in todo.items()}
        route.update({mb: [] for mb in todo})
        for s in range(len(self.pools)):
            alive = self._alive(s)
            chosen = {mb: pick(alive, self.rng) for mb in acts}
            sends = {mb: self.post(FORWARD, mb, w, step, acts[mb]) for mb, w in chosen.items()}
            for mb, w in chosen.items():
                if not self._wait(sends[mb], w, step):
                    continue
                rows = acts[mb].shape[0]
                reply = self.fetch((rows * self.out_features[s] + 1,), w, step)
                if reply is None:
                    continue
                self.speed[w] = 0.5 * self.speed[w] + 0.5 * rows / max(float(reply[-1]), 1e-6)
                acts[mb] = reply[:-1].view(rows, self.out_features[s])
                route[mb].append(w)
                served[w] = served.get(w, 0) + 1
            acts = {mb: a for mb, a in self.intact(acts, route).items()
                    if len(route[mb]) == s + 1}
        losses, grads = {}, {}
        for mb, out in acts.items():
            out = out.clone().requires_grad_()
            loss = loss_fn(out, todo[mb][1])
            (grads[mb],) = torch.autograd.grad(loss, out)
            losses[mb] = loss.item()
        for s in reversed(range(len(self.pools))):
            for mb in list(grads):
                w = route[mb][s]
                if not self.deliver(BACKWARD, mb, w, step, grads[mb]):
                    del grads[mb]
                    continue
                width = todo[mb][0].shape[1] if s == 0 else self.out_features[s - 1]
                dx = self.fetch((grads[mb].shape[0], width), w, step)
                if dx is None:
                    del grads[mb]
                else:
                    grads[mb] = dx
        return {mb: losses[mb] for mb in grads}

    def collect(self, counted: dict[int, float], route: dict[int, list[int]], step: int,
                micro: int) -> list[torch.Tensor] | None:
        """Each pool's mean gradient over the counted micro-batches, or None if a worker
        died while reporting (its micro-batches then no longer count)."""
        means = []
        for s, pool in enumerate(self.pools):
            total = None
            for w in pool:
                if w in self.dead:
                    continue
                ids = torch.tensor([mb for mb in counted if route[mb][s] == w], dtype=torch.int64,
                                   device=device())
                if not self.deliver(GRADS, 0, w, step, ids):
                    return None
                part = self.fetch((self.sizes[s],), w, step)
                if part is None:
                    return None
                total = part if total is None else total + part
            means.append(total / micro)
        return means


def swarm(model_fn: Callable[[], nn.Sequential], pools: list[list[int]],
          batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable, lr: float,
          microbatches: int, boundaries: Sequence[int] | None = None,
          slowdown: dict[int, float] | None = None, seed: int = 0,
          kill_at_step: dict[int, int] | None = None) -> SwarmReport | torch.Tensor:
    """Run on every rank: rank 0 trains, the ranks in `pools[s]` serve stage s of the
    model cut by `split_model`. `kill_at_step={rank: k}`: that worker dies (SIGKILL) at
    its first request of step k (0-based), however many forwards the routing gave it;
    `slowdown={rank: f}` makes it f times slower. The trainer returns a SwarmReport, a
    worker its stage's final parameters (flat)."""
    workers = [w for pool in pools for w in pool]
    if 0 in workers or len(set(workers)) != len(workers):
        raise ValueError(f"pools must list each worker rank once, without rank 0 (the "
                         f"trainer); got {pools}")
    stages = split_model(model_fn(), len(pools), boundaries)
    if rank() != 0:
        stage = next(s for s, pool in enumerate(pools) if rank() in pool)
        _worker(stages[stage], lr, (slowdown or {}).get(rank(), 1.0),
                (kill_at_step or {}).get(rank()))
        return parameters_to_vector(stages[stage].parameters()).detach()
    trainer = _Trainer(pools, stages, seed)
    for step, (x, y) in enumerate(batches):
        started = time.perf_counter()
        parts = dict(enumerate(zip(x.chunk(microbatches), y.chunk(microbatches),
                                   strict=True)))
        counted, route, served, means = {}, {}, {}, None
        while means is None:  # until every micro-batch counted and every pool reported
            while len(counted) < len(parts):
                todo = {mb: parts[mb] for mb in parts if mb not in counted}
                trainer.report.resent += sum(1 for mb in todo if mb in route)
                counted.update(trainer.wave(todo, step, loss_fn, served, route))
                counted = trainer.intact(counted, route)
            means = trainer.collect(counted, route, step, len(parts))
            counted = trainer.intact(counted, route)  # a worker may have died reporting
        for s, pool in enumerate(pools):
            for w in pool:
                trainer.deliver(UPDATE, 0, w, step, means[s])
        trainer.report.losses.append(sum(counted.values()) / len(counted))
        trainer.report.seconds.append(time.perf_counter() - started)
        trainer.report.served.append(served)
    for w in workers:
        trainer.deliver(STOP, 0, w, len(batches))
    return trainer.report


def _out_features(module: nn.Module) -> int:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("each stage must contain an nn.Linear (its last one sets the width "
                         "of what the stage sends on)")
    return linears[-1].out_features
