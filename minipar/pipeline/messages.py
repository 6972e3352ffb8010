"""A pipeline step's messages on this rank: activations and gradients to and from the
neighbouring stages' ranks, over minipar's metered point-to-point.

The messages between two compute actions (a gap of the plan: 1F1B's "send B0, receive
F1") are posted as one batch and its receives waited for before the next compute
action, as Megatron's `send_forward_recv_backward` pairs them. NCCL runs one batch's
messages at once but a rank's batches one after another, on one stream: posted one by
one, rank 0's "send F1" and rank 1's "send B0" would each wait for a receive queued
behind the other's send (docs/gpus.md shows the replay of that crossing).

The first step with a given batch shape sends each activation's shape ahead of it (a
header), in a batch of its own before the gap's data; the receiver learns every
message's shape, so later steps send no headers.
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
    sends: list[collectives.Pending] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shapes is not None:
            self.learnt = self.shapes

    @property
    def headers(self) -> bool:
        return self.shapes is None

    def _peer(self, a: Action) -> int:
        return self.plan.rank_of(a.peer_stage)

    @staticmethod
    def _names(a: Action) -> dict:
        # messages are labelled as the plan and the simulator label them ("1SEND_F0")
        return {"label": str(a), "stage": a.stage, "microbatch": a.microbatch}

    def exchange(self, gap: Sequence[Action], outgoing: dict[Action, torch.Tensor],
                 likes: dict[Action, torch.Tensor]) -> dict[Action, torch.Tensor]:
        """Post the gap's sends (`outgoing`: SEND_F/SEND_B -> tensor) and receives as one
        batch, wait for the receives and return them (RECV_F/RECV_B -> tensor). `likes`
        holds the output each RECV_B's gradient belongs to (its shape and dtype)."""
        receives = [a for a in gap if a.kind.is_recv]
        if self.headers:
            self._exchange_headers(gap, outgoing)
        for a in receives:
            if a.kind == ActionKind.RECV_B:  # a gradient has its output's shape
                self.learnt[a] = (likes[a].shape, likes[a].dtype)
        buffers = [torch.empty(self.learnt[a][0], dtype=self.learnt[a][1], device=device())
                   for a in receives]
        pending = collectives.post_together(
            [(outgoing[a], self._peer(a), self._names(a)) for a in gap if a.kind.is_send],
            [(b, self._peer(a), self._names(a)) for a, b in zip(receives, buffers, strict=True)],
            self.group)
        self.sends.append(pending)
        return dict(zip(receives, pending.received(), strict=True))

    def _exchange_headers(self, gap: Sequence[Action], outgoing: dict) -> None:
        """The first step: each activation's shape, in a batch before the data's."""
        sends = [(a, outgoing[a]) for a in gap if a.kind == ActionKind.SEND_F]
        recvs = [a for a in gap if a.kind == ActionKind.RECV_F]
        if not sends and not recvs:
            return
        headers = []
        for _, tensor in sends:
            header = torch.zeros(HEADER, dtype=torch.int64, device=tensor.device)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, device=tensor.device)
            headers.append(header)
        pending = collectives.post_together(
            [(h, self._peer(a), self._names(a)) for (a, _), h in zip(sends, headers,
                                                                    strict=True)],
            [(torch.zeros(HEADER, dtype=torch.int64, device=device()), self._peer(a),
              self._names(a)) for a in recvs], self.group)
        self.sends.append(pending)
        landed = pending.received()
        for a, header in zip(recvs, landed, strict=True):
            shape = header.tolist()  # the receiver needs the shape on the host to allocate
            self.learnt[a] = (shape[1:1 + shape[0]], self.dtype)

    def finish(self) -> Shapes:
        """Wait for every send (gloo has hung on a dropped request) and return the shapes
        learnt, for the next step with this batch shape."""
        for pending in self.sends:
            pending.wait()
        return self.learnt
