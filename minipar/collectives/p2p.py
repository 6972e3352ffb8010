"""Point to point: send and recv, isend and irecv (non-blocking, as pipelines need),
post_together (sends and receives that must progress together, in one batch), sendrecv
and recv_any, all metered like the collectives. Every message goes through
`host_staging.post`, one `batch_isend_irecv`: the way NCCL matches it (docs/gpus.md)."""

from __future__ import annotations

from collections.abc import Sequence

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


class Pending:
    """Messages posted together and not yet waited for. `wait()` blocks until every one
    has left or landed, meters each and returns the received tensors, in order
    (`received()` waits for the receives alone). A send's Timeline event spans from
    posting to the wait; a receive's only the time `wait()` was blocked, so a receive
    whose data is already there costs (nearly) nothing."""

    def __init__(self, sends: list, recvs: list, start: float) -> None:
        # (tensor, peer, requests, the Timeline's names for it)
        self.sends, self.recvs, self.start = sends, recvs, start
        self.recvs_done: list[torch.Tensor] = []

    def received(self) -> list[torch.Tensor]:
        """Wait for the receives only (the sends may still be leaving) and return them."""
        start = trace.now()
        for tensor, src, works, names in self.recvs:
            for work in works:
                work.wait()
            _account(Transfer("irecv", "p2p", 0, "recv", src, None, _nbytes(tensor)), start,
                     trace.now(), messages=len(works), **names)
        self.recvs_done += [entry[0] for entry in self.recvs]
        self.recvs = []
        return self.recvs_done

    def wait(self) -> list[torch.Tensor]:
        received = self.received()
        for tensor, dst, works, names in self.sends:
            for work in works:
                work.wait()
            _account(Transfer("isend", "p2p", 0, "send", dst, None, _nbytes(tensor)),
                     self.start, trace.now(), messages=len(works), **names)
        self.sends = []
        return received


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def post_together(sends: Sequence[tuple] = (), recvs: Sequence[tuple] = (),
                  group: dist.ProcessGroup | None = None, label: str | None = None,
                  **fields: int) -> Pending:
    """Post `sends` (tensor, dst) and `recvs` (contiguous tensor, src) as one batch and
    return without waiting. Messages that must progress together go in one call: NCCL
    runs one batch's sends and receives at once, but the batches a rank posts one after
    another in order, on one stream, so two ranks that each post a send before the
    receive that would match the other's deadlock there (Megatron pairs them the same
    way, in `send_forward_recv_backward`). Keep every tensor unchanged until `wait()`.
    `label` and `fields` (stage=, microbatch=) name the messages in the Timeline; a
    message's own names may follow its peer, (tensor, peer, {"label": ..., ...})."""
    return _post(Pending, sends, recvs, group, label, fields)


def _post(kind: type[Pending], sends: Sequence, recvs: Sequence,
          group: dist.ProcessGroup | None, label: str | None, fields: dict) -> Pending:
    size = dist.get_world_size(group)
    # torch's P2POp takes a global rank even when a group is given
    peer_of = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    flat_sends, flat_recvs, ops, sizes = [], [], [], []
    for tensor, dst, *names in sends:
        _check_tensor(tensor)
        _check_root("dst", dst, size)
        flat_sends.append((tensor.contiguous().view(-1), dst, *names))
    for tensor, src, *names in recvs:
        _check_tensor(tensor)
        _check_root("src", src, size)
        if not tensor.is_contiguous():
            raise ValueError("a receive needs a contiguous tensor to land in; pass "
                             "torch.empty_like(x) or x.contiguous()")
        flat_recvs.append((tensor, src, *names))
    start = trace.now()
    for op, entries in ((dist.isend, flat_sends), (dist.irecv, flat_recvs)):
        for tensor, peer, *_ in entries:
            data = tensor.view(-1)
            # the same segments and tags as exchange(), so a send() meets an irecv()
            cut = [(a, b) for a, b in _segments(data, group) if b > a]
            ops += [dist.P2POp(op, data[a:b], peer_of(peer), group, tag)
                    for tag, (a, b) in enumerate(cut)]
            sizes.append(len(cut))
    # the emulated network charges the sender here, so posting returns only after that sleep
    pay_for_sends((peer_of(entry[1]), _nbytes(entry[0])) for entry in flat_sends)
    works = post(ops)
    grouped, at = [], 0
    for n in sizes:
        grouped.append(works[at:at + n])
        at += n
    entries = [(t, peer, w, {"label": label, **fields, **(names[0] if names else {})})
               for (t, peer, *names), w in zip(flat_sends + flat_recvs, grouped, strict=True)]
    return kind(entries[:len(flat_sends)], entries[len(flat_sends):], start)


class PendingSend(Pending):
    """One send in flight (`isend`); `wait()` blocks until its data has left."""


class PendingRecv(Pending):
    """One receive in flight (`irecv`); `wait()` returns the tensor once the data is in."""

    def wait(self) -> torch.Tensor:
        return super().wait()[0]

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor the message lands in (read it after `wait()`)."""
        return self.recvs[0][0] if self.recvs else self.recvs_done[0]


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
          label: str | None = None, **fields: int) -> PendingSend:
    """Start sending `tensor` to `dst` without waiting; `.wait()` before changing `tensor`.
    Posted as a batch of one, like every minipar message, so that under NCCL it meets a
    `recv` on the group's communicator. A send that must progress with a receive (each
    rank of a ring sends, then receives) goes with it in one `post_together`."""
    return _post(PendingSend, [(tensor, dst)], (), group, label, fields)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None,
          label: str | None = None, **fields: int) -> PendingRecv:
    """Start receiving into `tensor` (contiguous) from `src` without waiting, so that a
    transfer overlaps computation; `.wait()` returns `tensor` once the data is in. Matches
    an `isend` or `send` of the same size."""
    return _post(PendingRecv, (), [(tensor, src)], group, label, fields)


def sendrecv(tensor: torch.Tensor, dst: int, into: torch.Tensor, src: int,
             group: dist.ProcessGroup | None = None, label: str | None = None,
             **fields: int) -> torch.Tensor:
    """Send `tensor` to `dst` while receiving `into` from `src`, in one batch, and wait for
    both: one step of a ring, or two ranks swapping (returns `into`)."""
    return post_together([(tensor, dst)], [(into, src)], group, label, **fields).wait()[0]


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
    if dist.get_backend() == "nccl":
        raise ValueError("recv_any needs backend='gloo': NCCL matches every receive to a "
                         "named source rank")
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
