"""Host staging: minipar's messages between GPU tensors over gloo.

gloo moves bytes over TCP sockets, out of and into host memory; its point-to-point send
and receive take CPU tensors only. When several ranks share one GPU under gloo
(`launch(..., backend="gloo", device="cuda")`, the way one card runs a whole mesh), every
message minipar posts passes through `post`: a send is copied to the host first, and a
receive lands in host memory and is copied onto its device tensor when it is waited for,
segment by segment, so a ring still adds early segments while later ones fly. NCCL moves
device memory itself, and a CPU tensor is already where gloo wants it: nothing is staged
there.

`forced()` stages CPU tensors too. Copies from host to host change no number, so a CPU
machine (CI has no GPU) can test that every path waits on and lands what it staged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_forced = False
staged_messages = 0  # messages this process has staged so far (tests read it)


@contextmanager
def forced() -> Iterator[None]:
    """Stage every message in the block, CPU tensors included (for tests on a CPU)."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous


def stages(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether a message on `tensor` over `group` must go through host memory."""
    if _forced:
        return True
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def wire_device(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor that travels beside `tensor` (a handshake's shapes, counts)
    should live: the host when `tensor`'s messages are staged, else `tensor`'s device."""
    return torch.device("cpu") if stages(tensor, group) else tensor.device


def host_buffer(tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A new buffer in host memory shaped like `tensor`: holding its data (`copy`, what a
    send reads), or not yet written (what a receive lands in)."""
    global staged_messages
    staged_messages += 1
    # what gloo reads and writes
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    return host.copy_(tensor) if copy else host


class _Staged:
    """A request on a host buffer. `wait()` waits for it, then, for a receive, copies the
    host buffer onto the device tensor it stands for."""

    def __init__(self, work: dist.Work, host: torch.Tensor,
                 target: torch.Tensor | None) -> None:
        self.work, self.host, self.target = work, host, target  # host lives until the wait

    def wait(self) -> bool:
        self.work.wait()
        if self.target is not None:
            self.target.copy_(self.host)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def post(ops: list[dist.P2POp]) -> list:
    """`dist.batch_isend_irecv(ops)`, each message that `stages` sent from or received into
    a host buffer. Returns one request per op, in order; a staged receive's data is on its
    device tensor once its `wait()` returns.

    Every minipar message goes through here, and always in a batch, a batch of one
    included: under NCCL a batch goes on the group's communicator, while a lone
    `dist.isend` goes on a communicator of its own for that pair, and the two never
    meet (ProcessGroupNCCL's pointToPoint, "for single P2P, preserve the old two-rank
    behavior"). The replay in collectives/nccl_replay.py holds the library to it."""
    posted, targets = [], []
    for op in ops:
        if not stages(op.tensor, op.group):
            posted.append(op)
            targets.append(None)
            continue
        receiving = op.op is dist.irecv
        host = host_buffer(op.tensor, copy=not receiving)
        posted.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        targets.append((host, op.tensor if receiving else None))
    works = dist.batch_isend_irecv(posted) if posted else []
    if len(works) == 1 < len(posted):
        # NCCL coalesces a batch into one request for all of it: each op waits on that one
        works = works * len(posted)
    return [work if target is None else _Staged(work, *target)
            for work, target in zip(works, targets, strict=True)]
