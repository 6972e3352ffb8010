"""Point to point: send, isend (non-blocking, as pipelines need), recv and recv_any,
all metered like the collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import trace
from .comm import (
    Transfer,
    _account,
    _check_root,
    _check_tensor,
    _Comm,
    _finish,
    _flat_work,
    _meters,
    _segments,
)
from .host_staging import host_buffer, post, stages
from .network import pay_for_sends


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send `tensor` to rank `dst` (metered, and an event in the Timeline)."""
    _check_tensor(tensor)
    comm = _Comm("send", group)
    _check_root("dst", dst, comm.size)
    # view(-1) needs contiguous memory; a strided tensor is copied first
    comm.exchange("p2p", sends=[(tensor.contiguous().view(-1), dst, None)])


class PendingSend:
    """A send in flight; `wait()` blocks until the data has left, then meters it."""

    def __init__(self, works: list, tensor: torch.Tensor, dst: int, start: float,
                 label: str | None = None, fields: dict | None = None) -> None:
        self.works, self.tensor, self.dst, self.start = works, tensor, dst, start
        self.label, self.fields = label, fields or {}

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        nbytes = self.tensor.numel() * self.tensor.element_size()
        _account(Transfer("isend", "p2p", 0, "send", self.dst, None, nbytes), self.start,
                 trace.now(), messages=len(self.works), label=self.label, **self.fields)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
          label: str | None = None, **fields: int) -> PendingSend:
    """Start sending `tensor` to `dst` without waiting (pipelines need it: with blocking
    sends, two stages that each send before receiving deadlock). Keep `tensor` unchanged
    and call `.wait()` on the result before reusing it. `label` and `fields` (stage=,
    microbatch=) name the message in the Timeline, as the pipeline engine does."""
    _check_tensor(tensor)
    size = dist.get_world_size(group)
    _check_root("dst", dst, size)
    data = tensor.contiguous().view(-1)
    # torch's isend takes a global rank even when a group is given
    peer = dst if group is None else dist.get_global_rank(group, dst)
    start = trace.now()
    segments = [(a, b) for a, b in _segments(data) if b > a]
    # the emulated network charges the sender here, so isend returns only after that sleep
    pay_for_sends((peer, (b - a) * data.element_size()) for a, b in segments)
    # the same segments and tags as exchange(), so a plain recv() on the other side matches
    # each segment on its own (not one batch): NCCL wants every rank of a group in the
    # first batch it sees, and a pipeline's first message is between two ranks only
    works = post([dist.P2POp(dist.isend, data[a:b], peer, group, tag)
                  for tag, (a, b) in enumerate(segments)], together=False)
    return PendingSend(works, data, dst, start, label, fields)


class PendingRecv:
    """A receive in flight; `wait()` blocks until the data has landed in the tensor, meters
    it and returns the tensor. Its Timeline event spans only the time `wait()` was
    blocked: a receive posted early whose data is already there costs (nearly) nothing."""

    def __init__(self, works: list, tensor: torch.Tensor, src: int,
                 label: str | None = None, fields: dict | None = None) -> None:
        self.works, self.tensor, self.src = works, tensor, src
        self.label, self.fields = label, fields or {}

    def wait(self) -> torch.Tensor:
        start = trace.now()
        for work in self.works:
            work.wait()
        nbytes = self.tensor.numel() * self.tensor.element_size()
        _account(Transfer("irecv", "p2p", 0, "recv", self.src, None, nbytes), start,
                 trace.now(), messages=len(self.works), label=self.label, **self.fields)
        return self.tensor


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None,
          label: str | None = None, **fields: int) -> PendingRecv:
    """Start receiving into `tensor` (contiguous) from `src` without waiting, so that a
    transfer overlaps computation (ring attention posts it before the block's math; the
    pipeline engine posts its next receives before each compute action). Matches an
    `isend` or `send` of the same size; `.wait()` before reading `tensor`. `label` and
    `fields` name the message in the Timeline, as for `isend`."""
    _check_tensor(tensor)
    if not tensor.is_contiguous():
        raise ValueError("irecv needs a contiguous tensor to receive into; pass "
                         "torch.empty_like(x) or x.contiguous()")
    size = dist.get_world_size(group)
    _check_root("src", src, size)
    data = tensor.view(-1)
    # as in isend: a global rank
    peer = src if group is None else dist.get_global_rank(group, src)
    ops = [dist.P2POp(dist.irecv, data[a:b], peer, group, tag)
           for tag, (a, b) in enumerate(_segments(data)) if b > a]
    works = post(ops, together=False)  # as in isend: each segment on its own
    return PendingRecv(works, tensor, src, label, fields)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None,
         label: str | None = None, **fields: int) -> torch.Tensor:
    """Receive into `tensor` from rank `src` (metered); returns `tensor`. `label` and
    `fields` name the message in the Timeline, as for `isend`."""
    _check_tensor(tensor)
    comm = _Comm("recv", group, label, **fields)
    _check_root("src", src, comm.size)
    flat = _flat_work(tensor)
    comm.exchange("p2p", recvs=[(flat, src, None)])
    return _finish(tensor, flat, "sum", 1)


def recv_any(tensor: torch.Tensor) -> int:
    """Receive into `tensor` from whichever rank sends first; returns that rank (gloo only:
    NCCL has no receive-from-any). Metered as one message of tensor's size."""
    _check_tensor(tensor)
    start = trace.now()
    # no src: gloo receives from any rank and returns which one it was
    landing = host_buffer(tensor, copy=False) if stages(tensor) else tensor
    source = dist.recv(landing)
    if landing is not tensor:
        tensor.copy_(landing)
    _account(Transfer("recv_any", "p2p", 0, "recv", source, None,
                      tensor.numel() * tensor.element_size()), start, trace.now())
    for m in _meters:
        m.steps += 1
    return source
