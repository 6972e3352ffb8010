"""Tutel-style pipelining: cut the dispatch and the combine all-to-all into chunks, so
that the experts compute chunk c while chunk c+1 is still arriving and chunk c-1's
results are on their way back. (Tutel re-chooses its pipelining degree at run time as
capacity changes; `choose_chunks` here measures once.)

Each rank cuts the rows it sends to every peer into `chunks` equal parts (tensor_split,
so sender and receiver agree on every part's size). Chunk c+1's dispatch is posted with
non-blocking sends and receives before the experts run on chunk c, and chunk c's
combine right after; both sides post in the same order, so the messages between two
ranks match. Gradients: each exchanged chunk is linked to the rows that were sent by
`_Arrive`, whose backward is the reverse exchange, so autograd sees an ordinary
all-to-all per chunk and direction (the backward is not overlapped).

As an exchange for ExpertParallelMoE: `ChunkedAllToAll(chunks)`. How many chunks is a
measurement (`choose_chunks`): more chunks hide more of the exchange
behind compute but pay more messages and smaller matmuls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import collectives
from ..runtime import device, rank, world_size
from ..trace import record
from .exchange import Compute, Exchange


def _parts(n: int, chunks: int) -> list[int]:
    """The sizes tensor_split gives n rows cut into `chunks` parts."""
    return [n // chunks + (i < n % chunks) for i in range(chunks)]


def start_exchange(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   group=None) -> tuple[list[torch.Tensor], list]:
    """A non-blocking all-to-all from point-to-point messages: post every send and receive,
    return (one receive buffer per source rank, the requests to wait on)."""
    k, me = world_size(group), rank(group)
    pieces = torch.split(rows, send_counts)
    buffers = [pieces[s].clone() if s == me else rows.new_empty(recv_counts[s], *rows.shape[1:])
               for s in range(k)]
    others = [peer for peer in range(k) if peer != me]
    # one batch: every rank sends first, so the sends must progress with the receives
    pending = collectives.post_together(
        [(pieces[p].contiguous(), p) for p in others if send_counts[p]],
        [(buffers[p], p) for p in others if recv_counts[p]], group)
    return buffers, [pending]


class _Arrive(torch.autograd.Function):
    """Forward: the rows that arrived (already exchanged). Backward: their gradient goes
    back to the ranks that sent them, as the gradient of the rows sent."""

    @staticmethod
    def forward(ctx, sent, received, send_counts, recv_counts, group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return received.clone()

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        back = collectives.all_to_all(grad.contiguous(), recv_counts, send_counts, ctx.group)
        return back, None, None, None, None


def run_by_expert(experts: Sequence[Callable], rows: torch.Tensor, which: torch.Tensor
                  ) -> torch.Tensor:
    """Each of this rank's `experts` (modules, or functions of their rows) on the rows
    whose `which` is its index; the outputs in the rows' order (no capacity buffer)."""
    out = rows.new_zeros(rows.shape)
    for i, expert in enumerate(experts):
        (index,) = torch.nonzero(which == i, as_tuple=True)
        out = out.index_put((index,), expert(rows[index]))
    return out


def pipelined_experts(rows: torch.Tensor, meta: torch.Tensor, send_counts: list[int],
                      recv_counts: list[int], compute: Callable, chunks: int,
                      group=None) -> torch.Tensor:
    """Dispatch `rows` (grouped by destination rank) in `chunks`, run the experts on each
    chunk as it arrives and send its results straight back: while the experts compute
    chunk c, chunk c+1's dispatch and chunk c-1's combine are on the wire. Returns the
    experts' outputs for `rows`, in the order of `rows`. `meta` holds the arriving rows'
    metadata on this rank (their local expert, ...), in arrival order (grouped by source
    rank); `compute(arrived, their meta)` runs this rank's experts on a chunk's rows."""
    k = world_size(group)
    out_parts = [_parts(n, chunks) for n in send_counts]  # [dest][chunk]
    in_parts = [_parts(n, chunks) for n in recv_counts]  # [source][chunk]
    by_dest = torch.split(rows, send_counts)
    sent = [torch.cat([torch.split(by_dest[d], out_parts[d])[c] for d in range(k)])
            for c in range(chunks)]
    by_source = torch.split(meta, recv_counts)
    chunk_meta = [torch.cat([torch.split(by_source[s], in_parts[s])[c] for s in range(k)])
                  for c in range(chunks)]
    send_c = [[out_parts[d][c] for d in range(k)] for c in range(chunks)]
    recv_c = [[in_parts[s][c] for s in range(k)] for c in range(chunks)]
    combines = []
    pending = start_exchange(sent[0].detach(), send_c[0], recv_c[0], group)
    for c in range(chunks):
        buffers, requests = pending
        for request in requests:
            request.wait()
        if c + 1 < chunks:  # on the wire while the experts compute chunk c
            pending = start_exchange(sent[c + 1].detach(), send_c[c + 1], recv_c[c + 1], group)
        arrived = _Arrive.apply(sent[c], torch.cat(buffers), send_c[c], recv_c[c], group)
        with record("compute", f"experts, chunk {c}", tokens=int(arrived.shape[0])):
            out = compute(arrived, chunk_meta[c])
        # chunk c's results go back now, during the next chunk's experts
        combines.append((out, start_exchange(out.detach(), recv_c[c], send_c[c], group)))
    returned = []
    for c, (out, (buffers, requests)) in enumerate(combines):
        for request in requests:
            request.wait()
        back = _Arrive.apply(out, torch.cat(buffers), recv_c[c], send_c[c], group)
        returned.append(torch.split(back, send_c[c]))
    return torch.cat([returned[c][d] for d in range(k) for c in range(chunks)])


class ChunkedAllToAll(Exchange):
    """The flat all-to-all cut into `chunks` per direction, the experts of each chunk
    overlapped with the next chunk's dispatch and the previous one's combine (Tutel's
    pipelining; 1 = the same point-to-point exchange without overlap)."""

    all_at_once = False  # the experts run on each chunk's rows: no capacity buffer

    def __init__(self, chunks: int) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an int >= 1; got {chunks!r}")
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"ChunkedAllToAll({self.chunks})"

    def round_trip(self, rows: torch.Tensor, meta: torch.Tensor, send_counts: list[int],
                   compute: Compute, group=None) -> torch.Tensor:
        recv_counts = collectives.swap_counts(send_counts, group)  # rows from each rank
        # the metadata is small: it travels whole, ahead of the chunks, so every chunk's
        # rows know their expert on arrival
        arrived_meta = collectives.all_to_all(meta.contiguous(), send_counts, recv_counts,
                                              group)
        return pipelined_experts(rows, arrived_meta, send_counts, recv_counts, compute,
                                 self.chunks, group)


def step_seconds(step, repeats: int = 3, group=None) -> float:
    """The slowest rank's median seconds of `step()` (a forward + backward), on every rank
    alike, after one warm-up call."""
    runs = []
    for _ in range(repeats + 1):
        torch.distributed.barrier(group=group)
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    seconds = torch.tensor([sorted(runs[1:])[repeats // 2]], dtype=torch.float64,
                           device=device())
    return collectives.all_reduce(seconds, op="max", group=group).item()


def choose_chunks(layer: nn.Module, x: torch.Tensor, candidates: tuple[int, ...] = (1, 2, 4),
                  repeats: int = 3) -> dict[int, float]:
    """Time forward + backward of an ExpertParallelMoE with a `ChunkedAllToAll` of each
    chunk count (the slowest rank's median), set the fastest as the layer's exchange, and
    return every time."""
    times = {}
    for chunks in candidates:
        layer.exchange = ChunkedAllToAll(chunks)
        times[chunks] = step_seconds(lambda: layer(x).pow(2).mean().backward(), repeats,
                                     layer.group)
    layer.zero_grad(set_to_none=True)
    layer.exchange = ChunkedAllToAll(min(times, key=times.get))
    return times
