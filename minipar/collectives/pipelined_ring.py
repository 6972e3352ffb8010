"""The pipelined ring all-reduce: the ring's 2(K-1) steps without a wait between them.

The plain ring (`all_reduce(algorithm="ring")`) finishes a whole step, every segment of
its chunk sent, received and reduced, before the next begins. But segment j of step s+1
is segment j of what arrived in step s, so it can leave as soon as that segment has
landed and been added, while later segments of step s are still in flight. Bytes on
each link are the same as the plain ring's; what it can win is the time a step waits for
its slowest segment and the additions, where a spare core or a GPU's copy engine lets
them run beside the transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import trace
from .comm import (
    _agree,
    _check_op,
    _check_tensor,
    _combine,
    _Comm,
    _finish,
    _flat_work,
    _meters,
    _scratch,
    _segments,
)
from .host_staging import post


@dataclass
class _InFlight:
    """One segment posted at one step: its request, where it lives, when it started."""

    work: object
    step: int
    chunk: int
    data: torch.Tensor  # the segment sent, or the slice a receive lands in
    into: torch.Tensor | None  # a receive to add into this slice of a chunk, else None
    start: float


def _step_chunks(step: int, size: int, me: int) -> tuple[int, int]:
    """(chunk sent, chunk received) at a step: the ring's reduce-scatter for the first
    K-1 steps, its all-gather after; what arrives at step s is what leaves at s+1."""
    if step < size - 1:
        return (me - step - 1) % size, (me - step - 2) % size
    t = step - (size - 1)
    return (me - t) % size, (me - t - 1) % size


def pipelined_ring_all_reduce(tensor: torch.Tensor, op: str = "sum",
                              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in place with the ring's messages, each segment forwarded as soon as it
    has arrived (and, in the reduce-scatter half, been added): the steps overlap.

    Every (step, segment) is one send to the right and one receive from the left, posted
    together; before sending segment j of step s+1 a rank waits only for segment j of
    step s. Receives of the reduce-scatter half land in a scratch row of their own per
    step, so no buffer is reused while a message may still be writing it.
    """
    _check_tensor(tensor)
    _check_op(op, tensor)
    comm = _Comm("all_reduce", group, label="pipelined ring")
    _agree(comm, tensor, op)
    flat = _flat_work(tensor)
    if comm.size == 1:
        return _finish(tensor, flat, op, 1)
    size, me = comm.size, comm.rank
    right, left = comm.global_rank((me + 1) % size), comm.global_rank((me - 1) % size)
    chunks = list(torch.tensor_split(flat, size))
    width = max(c.numel() for c in chunks)
    # a row per reduce-scatter step: a segment of step s may still be landing while step s+1's
    # receives are posted, so they cannot share one buffer as the plain ring's steps do
    scratch = _scratch(flat, (size - 1) * width)
    tags = max(len(_segments(c)) for c in chunks)  # tag = step * tags + segment
    arrived: list[_InFlight] = []  # the previous step's receives, segment by segment
    sent: list[_InFlight] = []
    for step in range(2 * (size - 1)):
        out_i, in_i = _step_chunks(step, size, me)
        adding = step < size - 1
        # all-gather steps receive straight into the chunk: nothing is added, so no scratch needed
        landing = scratch[step * width:][:chunks[in_i].numel()] if adding else chunks[in_i]
        outgoing = [(a, b) for a, b in _segments(chunks[out_i]) if b > a]
        incoming = [(a, b) for a, b in _segments(chunks[in_i]) if b > a]
        posted: list[_InFlight] = []
        for j in range(max(len(outgoing), len(incoming))):
            if j < len(arrived):  # what leaves now is what arrived last step
                _land(comm, arrived[j], op)
            ops, start = [], trace.now()
            if j < len(outgoing):
                a, b = outgoing[j]
                ops.append(dist.P2POp(dist.isend, chunks[out_i][a:b], right, group,
                                      step * tags + j))
            if j < len(incoming):
                a, b = incoming[j]
                ops.append(dist.P2POp(dist.irecv, landing[a:b], left, group, step * tags + j))
            # the send and the receive of one segment posted together, as in _Comm.exchange
            works = post(ops)
            if j < len(outgoing):
                a, b = outgoing[j]
                sent.append(_InFlight(works[0], step, out_i, chunks[out_i][a:b], None, start))
            if j < len(incoming):
                a, b = incoming[j]
                # the receive, if any, is the last request
                posted.append(_InFlight(works[-1], step, in_i, landing[a:b],
                                        chunks[in_i][a:b] if adding else None, start))
        arrived = posted
    for segment in arrived:
        _land(comm, segment, op)
    for segment in sent:
        segment.work.wait()
        _note(comm, "send", (me + 1) % size, segment)
    for m in _meters:
        m.steps += 2 * (size - 1)
    return _finish(tensor, flat, op, size)


def _land(comm: _Comm, segment: _InFlight, op: str) -> None:
    """Wait for a received segment, add it into its chunk if it is a partial sum, meter it."""
    segment.work.wait()
    if segment.into is not None:
        _combine(segment.into, segment.data, op)
    _note(comm, "recv", (comm.rank - 1) % comm.size, segment)


def _note(comm: _Comm, direction: str, peer: int, segment: _InFlight) -> None:
    phase = "reduce-scatter" if segment.step < comm.size - 1 else "all-gather"
    comm._note(direction, phase, peer, segment.chunk,
               segment.data.numel() * segment.data.element_size(), segment.start, trace.now(),
               step=segment.step)
