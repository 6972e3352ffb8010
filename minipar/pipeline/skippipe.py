"""SkipPipe (2025): partial and reordered pipelining for stages of uneven speed.

A pipeline is as fast as its slowest stage, every micro-batch visiting every stage in
order. SkipPipe lets a micro-batch skip some of the middle stages (as stochastic-depth /
LayerDrop training does) and visit the others in a different order, and plans the paths
so that slow stages are visited less and the micro-batches do not queue at the same
stage at once. The first stage (input) and the last (head and loss) are never skipped.

Here the middle stages are residual blocks (x + tanh(W x)), so a skipped stage is the
identity and any order is well formed. `plan_paths` picks each middle stage's share of
visits in proportion to its speed and rotates each micro-batch's order; `simulate_paths`
lays the paths out on a Timeline (each stage runs the ready operation that can start
first; a backward costs twice its forward); `train_paths` runs them on real ranks, one
stage per rank, and equals `one_process_paths`, the same model and paths on one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..runtime import device, rank, world_size
from ..trace import Event, Timeline, record

Path = tuple[int, ...]


class Residual(nn.Module):
    """x + tanh(W x): a middle stage that can be skipped (identity) or reordered."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def skip_model(features: int, width: int, stages: int, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> nn.ModuleList:
    """Stage 0: Linear(features, width) + tanh; stages 1..S-2: Residual(width); stage S-1:
    Linear(width, 1)."""
    if stages < 3:
        raise ValueError(f"stages must be >= 3 (input, at least one middle, head); got {stages}")
    torch.manual_seed(seed)
    # seeded on the host, then moved: the same model on any device
    stages_ = nn.ModuleList([nn.Sequential(nn.Linear(features, width, dtype=dtype),
                                           nn.Tanh()),
                             *[Residual(width, dtype) for _ in range(stages - 2)],
                             nn.Linear(width, 1, dtype=dtype)])
    return stages_.to(device())


def plan_paths(stages: int, microbatches: int, skip: int, speeds: Sequence[float] | None = None,
               reorder: bool = True) -> list[Path]:
    """Every micro-batch's path: stage 0, `stages - 2 - skip` middle stages, the last one.
    Middle stage j gets visits in proportion to speeds[j] (at most one per micro-batch);
    with `reorder` each micro-batch starts its middle stages at a different one."""
    middle = list(range(1, stages - 1))
    keep = len(middle) - skip
    if not 0 <= skip <= len(middle):
        raise ValueError(f"skip must be from 0 to {len(middle)} (middle stages); got {skip}")
    speeds = list(speeds) if speeds is not None else [1.0] * stages
    if len(speeds) != stages or min(speeds) <= 0:
        raise ValueError(f"speeds must give {stages} positive numbers; got {speeds}")
    total = microbatches * keep
    weight = sum(speeds[j] for j in middle) or 1.0
    share = {j: min(microbatches, total * speeds[j] / weight) for j in middle}
    visits = {j: int(share[j]) for j in middle}
    for j in sorted(middle, key=lambda j: share[j] - visits[j], reverse=True):
        if sum(visits.values()) < total and visits[j] < microbatches:
            visits[j] += 1  # largest remainders first
    while sum(visits.values()) < total:  # caps pushed visits elsewhere: fill the fastest
        j = max((j for j in middle if visits[j] < microbatches), key=lambda j: speeds[j])
        visits[j] += 1
    chosen: list[list[int]] = [[] for _ in range(microbatches)]
    for j in sorted(middle, key=lambda j: -visits[j]):
        for mb in sorted(range(microbatches), key=lambda mb: (len(chosen[mb]), mb))[:visits[j]]:
            chosen[mb].append(j)
    paths = []
    for mb, mid in enumerate(chosen):
        mid.sort()
        if reorder and mid:
            turn = mb % len(mid)
            mid = mid[turn:] + mid[:turn]
        paths.append((0, *mid, stages - 1))
    return paths


def simulate_paths(paths: Sequence[Path], forward: Sequence[float], link: float = 0.0,
                   send: float = 0.0) -> Timeline:
    """One step of `paths`: forward along each path, backward (2x the forward's cost) back
    along it; a message between stages takes `link` seconds on the wire and `send` seconds
    of its sender's time (the sender can do nothing else meanwhile: a blocking send, or
    what each message costs the CPU at its end), so a stage's next operation waits for
    its sends. Each stage runs, among its ready operations, the one that can start
    first. Rank r of the Timeline is stage r."""
    stages = len(forward)
    ops = {}  # (mb, i): the i-th operation of micro-batch mb's forward-then-backward chain
    for mb, path in enumerate(paths):
        chain = [(s, "F") for s in path] + [(s, "B") for s in reversed(path)]
        for i, (s, kind) in enumerate(chain):
            ops[(mb, i)] = (s, kind, forward[s] * (2 if kind == "B" else 1), len(chain))
    free = [0.0] * stages
    ready = [(0.0, mb, 0) for mb in range(len(paths))]  # (time it can start, mb, index)
    events = []
    while ready:
        best = min(ready, key=lambda c: (max(c[0], free[ops[(c[1], c[2])][0]]), c[1], c[2]))
        ready.remove(best)
        at, mb, i = best
        s, kind, cost, length = ops[(mb, i)]
        start = max(at, free[s])
        free[s] = start + cost
        events.append(Event(s, kind, f"{kind}{mb}", start, start + cost, stage=s, microbatch=mb))
        if i + 1 < length:
            nxt = ops[(mb, i + 1)][0]
            if nxt != s:  # a message: its sender is busy sending, then it travels
                free[s] += send
                ready.append((free[s] + link, mb, i + 1))
            else:
                ready.append((free[s], mb, i + 1))
    return Timeline(events)


def stage_orders(timeline: Timeline) -> list[list[tuple[str, int]]]:
    """Each stage's operations, (kind, micro-batch), in the order the Timeline runs them."""
    orders: list[list[tuple[str, int]]] = [[] for _ in range(max(timeline.ranks) + 1)]
    for e in sorted(timeline.events, key=lambda e: (e.start, e.rank)):
        orders[e.rank].append((e.kind, e.microbatch))
    return orders


class _Mailbox:
    """Messages from one peer arrive in its send order; keep the ones not needed yet."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        self.width, self.dtype, self.kept = width, dtype, {}

    def get(self, src: int, key: tuple[int, int]) -> torch.Tensor:
        while (src, *key) not in self.kept:
            header = torch.zeros(3, dtype=torch.int64, device=device())
            kind, mb, rows = collectives.recv(header, src).tolist()
            data = torch.zeros(rows, self.width, dtype=self.dtype, device=device())
            data = collectives.recv(data, src)
            self.kept[(src, kind, mb)] = data
        return self.kept.pop((src, *key))


def _post(dst: int, kind: int, mb: int, data: torch.Tensor) -> list:
    return [collectives.isend(torch.tensor([kind, mb, data.shape[0]], device=data.device), dst),
            collectives.isend(data.contiguous(), dst)]


def train_paths(model_fn: Callable[[], nn.ModuleList], steps: Sequence[tuple], plans:
                Sequence[Sequence[Path]], loss_fn: Callable, lr: float,
                forward_seconds: Sequence[float] | None = None
                ) -> tuple[list[float], torch.Tensor]:
    """On every rank (rank r = stage r): each step's micro-batches along their planned
    paths, in the order the simulator gives each stage; SGD on the mean micro-batch loss.
    `forward_seconds[r]`: stage r's forward lasts at least that long and its backward
    twice that (a sleep: devices of different speeds, as the simulator's costs). Returns
    (the last stage's losses,
    this stage's final parameters)."""
    me, stages = rank(), world_size()
    stage = model_fn()[me]
    params = list(stage.parameters())
    width = stage.linear.in_features if isinstance(stage, Residual) else \
        (stage[0].out_features if me == 0 else stage.in_features)
    mail = _Mailbox(width, params[0].dtype)
    losses, pending = [], []
    for (x, y), paths in zip(steps, plans, strict=True):
        micro = len(paths)
        xs, ys = x.chunk(micro), y.chunk(micro)
        costs = list(forward_seconds) if forward_seconds else [1.0] * stages  # the speeds
        order = stage_orders(simulate_paths(paths, costs))[me]
        saved, step_loss = {}, 0.0
        grads = [torch.zeros_like(p) for p in params]
        for kind, mb in order:
            path = list(paths[mb])
            where = path.index(me)
            start = time.perf_counter()
            with record("compute", f"{kind}{mb}", microbatch=mb):
                if kind == "F":
                    inp = xs[mb] if where == 0 else mail.get(path[where - 1], (0, mb))
                    inp = inp.detach().requires_grad_(where > 0)
                    out = stage(inp)
                    if where == len(path) - 1:
                        out = loss_fn(out, ys[mb])
                        step_loss += out.item() / micro
                    else:
                        pending += _post(path[where + 1], 0, mb, out.detach())
                    saved[mb] = (inp, out)
                else:
                    inp, out = saved.pop(mb)
                    g = torch.ones_like(out) / micro if where == len(path) - 1 else \
                        mail.get(path[where + 1], (1, mb))
                    wanted = [inp, *params] if where > 0 else params
                    found = torch.autograd.grad(out, wanted, g)
                    for acc, d in zip(grads, found[-len(params):], strict=True):
                        acc += d
                    if where > 0:
                        pending += _post(path[where - 1], 1, mb, found[0])
                if forward_seconds:
                    wanted = forward_seconds[me] * (2 if kind == "B" else 1)
                    time.sleep(max(wanted - (time.perf_counter() - start), 0.0))
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= lr * g
        losses.append(step_loss)
    for request in pending:
        request.wait()
    return losses, parameters_to_vector(params).detach()


def one_process_paths(model: nn.ModuleList, steps: Sequence[tuple],
                      plans: Sequence[Sequence[Path]], loss_fn: Callable,
                      lr: float) -> list[float]:
    """The reference: each micro-batch through its path's stages, SGD on the mean loss."""
    losses = []
    for (x, y), paths in zip(steps, plans, strict=True):
        micro = len(paths)
        loss = sum(loss_fn(_through(model, path, xi), yi)
                   for path, xi, yi in zip(paths, x.chunk(micro), y.chunk(micro), strict=True)
                   ) / micro
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        losses.append(loss.item())
    return losses


def _through(model: nn.ModuleList, path: Path, x: torch.Tensor) -> torch.Tensor:
    for s in path:
        x = model[s](x)
    return x
