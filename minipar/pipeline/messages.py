"""A pipeline step's messages on this rank: activations and gradients to and from the
neighbouring stages' ranks, over minipar's metered point-to-point.

The engine posts them in the batches message_plan.py chose: each batch's sends and
receives together, as Megatron's `send_forward_recv_backward` pairs them, and its
receives waited for before the next compute action. NCCL runs one batch's messages at
once but a rank's batches one after another, on one stream; posted one by one, rank 0's
"send F1" and rank 1's "send B0" would each wait for a receive queued behind the
other's (docs/gpus.md shows the replay of that crossing).

A receiver must know a message's shape before it posts the receive. A gradient has its
output's shape; an activation's shape is published in the rendezvous store by its
sender on the first step with a batch shape, and read there by its receiver: a side
channel, so no header queues on the data's stream. Later steps use the shapes learnt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import message_log
from ..runtime import device
from .message_plan import shape_key
from .plan import Action, ActionKind, Schedule

Shapes = dict[Action, tuple[Sequence[int], torch.dtype]]


@dataclass
class Messages:
    """One step's sends and receives. `shapes` is None on the first step with a batch
    shape (each activation's shape goes through the rendezvous store, under names that
    begin with `name`) and the shapes learnt then afterwards."""

    plan: Schedule
    group: dist.ProcessGroup | None
    dtype: torch.dtype  # activations' dtype: the stages' parameters'
    shapes: Shapes | None
    name: str = ""  # the pipeline and step, the same on every rank of the pipeline
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

    def _key(self, a: Action) -> str:
        return f"minipar/pipeline/{self.name}/{shape_key(a)}"

    def publish(self, a: Action, out: torch.Tensor) -> None:
        """After F `a` (whose output goes to another rank): on the first step, its shape
        in the store, for the receiver to size its buffer before it posts."""
        if self.headers:
            key = self._key(Action(a.stage, ActionKind.SEND_F, a.microbatch))
            message_log.note("publish", key)
            _store().set(key, ",".join(map(str, out.shape)))

    def exchange(self, batch: Sequence[Action], outgoing: dict[Action, torch.Tensor],
                 likes: dict[Action, torch.Tensor]) -> dict[Action, torch.Tensor]:
        """Post the batch's sends (`outgoing`: SEND_F/SEND_B -> tensor) and receives
        together, wait for the receives and return them (RECV_F/RECV_B -> tensor).
        `likes` holds the output each RECV_B's gradient belongs to (its shape, dtype)."""
        receives = [a for a in batch if a.kind.is_recv]
        for a in receives:
            if a.kind == ActionKind.RECV_B:  # a gradient has its output's shape
                self.learnt[a] = (likes[a].shape, likes[a].dtype)
            elif self.headers:
                key = self._key(a)
                message_log.note("await", key)
                # blocks until the sender has published it; each name is read once
                text = _store().get(key).decode()
                _store().delete_key(key)
                self.learnt[a] = ([int(n) for n in text.split(",")], self.dtype)
        buffers = [torch.empty(self.learnt[a][0], dtype=self.learnt[a][1], device=device())
                   for a in receives]
        pending = collectives.post_together(
            [(outgoing[a], self._peer(a), self._names(a)) for a in batch if a.kind.is_send],
            [(b, self._peer(a), self._names(a)) for a, b in zip(receives, buffers, strict=True)],
            self.group)
        self.sends.append(pending)
        return dict(zip(receives, pending.received(), strict=True))

    def finish(self) -> Shapes:
        """Wait for every send (gloo has hung on a dropped request) and return the shapes
        learnt, for the next step with this batch shape."""
        for pending in self.sends:
            pending.wait()
        return self.learnt


def _store() -> dist.Store:
    # the rendezvous store every rank joined through: a side channel that no NCCL stream
    # orders (a private accessor; torch.distributed.pipelining's shape inference sends
    # objects over the group instead, before the first step)
    return dist.distributed_c10d._get_default_store()
