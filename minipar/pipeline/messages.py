"""A pipeline step's messages on this rank: activations and gradients to and from the
neighbouring stages' ranks, over minipar's metered point-to-point.

The first step with a given batch shape sends each activation's shape ahead of it (a
header); the receiver learns every message's shape, so later steps send no headers and
can post each receive (irecv) before the compute action it follows, letting the data
land while the rank computes instead of while it waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import collectives
from ..runtime import device
from .plan import Action, ActionKind, Schedule

HEADER = 9  # ndim + up to 8 dimensions, sent before an activation of unknown shape
Shapes = dict[Action, tuple[Sequence[int], torch.dtype]]


@dataclass
class Messages:
    """One step's sends and receives. `shapes` is None on the first step with a batch
    shape (headers go with the activations) and the shapes learnt then afterwards."""

    plan: Schedule
    group: dist.ProcessGroup | None
    dtype: torch.dtype  # activations' dtype: the stages' parameters'
    shapes: Shapes | None
    learnt: Shapes = field(default_factory=dict)  # every receive's shape, for later steps
    posted: dict[Action, collectives.PendingRecv] = field(default_factory=dict)
    posted_upto: int = 0  # actions before this index have had their receives posted
    sends: list[collectives.PendingSend] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shapes is not None:
            self.learnt = self.shapes

    @property
    def headers(self) -> bool:
        return self.shapes is None

    def _tag(self, a: Action) -> dict:
        # messages are labelled as the plan and the simulator label them ("1SEND_F0")
        return {"label": str(a), "stage": a.stage, "microbatch": a.microbatch}

    def post_ahead(self, actions: Sequence[Action], index: int) -> None:
        """Post (irecv) every receive up to the second compute action from `index`, so each
        message lands while this rank computes the action before it. Receives are posted in
        plan order, the order the peer sends in, so messages match as they did blocking."""
        if self.headers:  # shapes unknown: receives wait for their headers
            return
        computes, end = 0, index
        while end < len(actions) and computes < 2:
            computes += actions[end].is_compute
            end += 1
        for a in actions[self.posted_upto:end]:
            if a.kind.is_recv:
                self._post(a)
        self.posted_upto = max(self.posted_upto, end)

    def _post(self, a: Action) -> None:
        shape, dtype = self.learnt[a]
        self.posted[a] = collectives.irecv(torch.empty(shape, dtype=dtype, device=device()),
                                           self.plan.rank_of(a.peer_stage), self.group,
                                           **self._tag(a))

    def receive(self, a: Action, like: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `a` (RECV_F or RECV_B) receives; `like` is the output a gradient
        belongs to (its shape and dtype), for the first step's RECV_B."""
        if not self.headers:  # shape known: no header
            if a not in self.posted:  # not posted ahead
                self._post(a)
            return self.posted.pop(a).wait()
        src = self.plan.rank_of(a.peer_stage)
        if a.kind == ActionKind.RECV_F:  # first step with this batch shape: the shape first
            header = torch.zeros(HEADER, dtype=torch.int64, device=device())
            header = collectives.recv(header, src, self.group, **self._tag(a))
            shape = header[1:1 + int(header[0])].tolist()
            self.learnt[a] = (shape, self.dtype)
            buffer = torch.empty(shape, dtype=self.dtype, device=device())
            return collectives.recv(buffer, src, self.group, **self._tag(a))
        grad = torch.empty_like(like)  # a gradient has its output's shape: no header needed
        self.learnt[a] = (grad.shape, grad.dtype)
        return collectives.recv(grad, src, self.group, **self._tag(a))

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Start sending `tensor` for `a` (SEND_F or SEND_B); `finish` waits for it."""
        dst = self.plan.rank_of(a.peer_stage)
        if self.headers and a.kind == ActionKind.SEND_F:
            header = torch.zeros(HEADER, dtype=torch.int64, device=tensor.device)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, device=tensor.device)
            self.sends.append(collectives.isend(header, dst, self.group, **self._tag(a)))
        self.sends.append(collectives.isend(tensor, dst, self.group, **self._tag(a)))

    def finish(self) -> Shapes:
        """Wait for every send (gloo has hung on a dropped request) and return the shapes
        learnt, for the next step with this batch shape."""
        for pending in self.sends:
            pending.wait()
        return self.learnt
