"""All-reduce four ways (naive, tree, ring, recursive halving/doubling), and the ring's
two halves on their own: reduce-scatter and all-gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import (
    ALL_REDUCE_ALGORITHMS,
    ROOTED_ALGORITHMS,
    _agree,
    _check_algorithm,
    _check_op,
    _check_tensor,
    _Comm,
    _finish,
    _flat_work,
    _reduce_as_it_lands,
    _scratch,
    split_bounds,
)
from .rooted import _broadcast_from, _reduce_into


def _ring_reduce_scatter(comm: _Comm, chunks: list[torch.Tensor], op: str) -> None:
    """K-1 steps; at step s rank r passes chunk r-s-1 right and reduces chunk r-s-2 from
    the left, so rank r ends holding the full reduction of chunk r."""
    size, me = comm.size, comm.rank
    right, left = (me + 1) % size, (me - 1) % size
    # one receive buffer for every step, as long as the longest chunk (tensor_split's chunks
    # differ by at most one element)
    scratch = _scratch(chunks[0], max(c.numel() for c in chunks))
    for s in range(size - 1):
        out_i, in_i = (me - s - 1) % size, (me - s - 2) % size
        incoming = scratch[:chunks[in_i].numel()]
        comm.exchange("reduce-scatter", sends=[(chunks[out_i], right, out_i)],
                      recvs=[(incoming, left, in_i)],
                      on_arrival=_reduce_as_it_lands([chunks[in_i]], [incoming], op))


def _ring_all_gather(comm: _Comm, chunks: list[torch.Tensor]) -> None:
    """K-1 steps; rank r starts with chunk r and forwards what it last received."""
    size, me = comm.size, comm.rank
    right, left = (me + 1) % size, (me - 1) % size
    for s in range(size - 1):
        out_i, in_i = (me - s) % size, (me - s - 1) % size
        comm.exchange("all-gather", sends=[(chunks[out_i], right, out_i)],
                      recvs=[(chunks[in_i], left, in_i)])


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank gets all ranks' tensors concatenated along dim 0 in rank order (ring)."""
    _check_tensor(tensor)
    comm = _Comm("all_gather", group)
    _agree(comm, tensor)
    piece = tensor.contiguous()
    out = torch.empty((comm.size, *piece.shape), dtype=piece.dtype, device=piece.device)
    # row r is rank r's piece: the ring fills the other rows in place, through views
    out[comm.rank] = piece
    comm.buffer = out
    _ring_all_gather(comm, [out[r].view(-1) for r in range(comm.size)])
    # a 0-d tensor has no dim 0 to concatenate along: it comes back as shape (K,)
    return out.reshape(comm.size * piece.shape[0], *piece.shape[1:]) if piece.dim() else out


def reduce_scatter(tensor: torch.Tensor, op: str = "sum",
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank r gets chunk r (tensor_split along dim 0) of the reduction of all ranks' tensors."""
    _check_tensor(tensor)
    _check_op(op, tensor)
    comm = _Comm("reduce_scatter", group)
    _agree(comm, tensor, op)
    # a copy: the input stays as it was; detach: collectives move data, not autograd history
    work = tensor.detach().clone().contiguous()
    comm.buffer = work
    chunks = [c.reshape(-1) for c in torch.tensor_split(work, comm.size)]
    if comm.size > 1:
        _ring_reduce_scatter(comm, chunks, op)
    # clone: the result must not keep the whole work buffer alive through a view
    mine = torch.tensor_split(work, comm.size)[comm.rank].clone()
    if op == "avg":
        mine.div_(comm.size)
    return mine


def _halving_doubling(comm: _Comm, flat: torch.Tensor, op: str) -> None:
    """Rabenseifner's all-reduce. With K not a power of two, the first 2R ranks
    (R = K - P, P the largest power of two <= K) fold in pairs first and are sent the
    result at the end: one extra step each way, so still ceil(log2 K) steps per phase."""
    size, me = comm.size, comm.rank
    # P, the largest power of two <= K
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    incoming = _scratch(flat, flat.numel())

    # virtual rank -> real rank: of each folded pair the odd rank carries on (it holds the
    # pair's sum); ranks past the pairs shift down by R
    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    virtual = -1
    if extra:
        if me < 2 * extra and me % 2 == 0:
            comm.exchange("fold", sends=[(flat, me + 1, None)])
        elif me < 2 * extra:
            comm.exchange("fold", recvs=[(incoming, me - 1, None)],
                          on_arrival=_reduce_as_it_lands([flat], [incoming], op))
            virtual = me // 2
        else:
            # an empty step: every rank counts the same steps, so step numbers line up in the
            # Timeline
            comm.exchange("fold")
            virtual = me - extra
    else:
        virtual = me
    # the vector in P blocks; [lo, hi) below counts blocks, not elements
    bounds = split_bounds(flat.numel(), p)
    lo, hi = 0, p
    distance = p // 2
    while distance >= 1:  # halving: keep half the range, send the other half
        if virtual >= 0:
            # partners differ in one bit (a hypercube); the one with the bit clear keeps the lower
            # half
            partner, mid = virtual ^ distance, (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if virtual & distance == 0 else ((mid, hi),
                                                                                  (lo, mid))
            kept = flat[bounds[keep[0]]:bounds[keep[1]]]
            scratch = incoming[:kept.numel()]
            comm.exchange("reduce-scatter",
                          sends=[(flat[bounds[give[0]]:bounds[give[1]]], real(partner), None)],
                          recvs=[(scratch, real(partner), None)],
                          on_arrival=_reduce_as_it_lands([kept], [scratch], op))
            lo, hi = keep
        else:
            comm.exchange("reduce-scatter")
        distance //= 2
    distance = 1
    while distance < p:  # doubling: swap ranges with the partner, the range doubles
        if virtual >= 0:
            partner, width = virtual ^ distance, hi - lo
            other = (lo - width, lo) if virtual & distance else (hi, hi + width)
            comm.exchange("all-gather", sends=[(flat[bounds[lo]:bounds[hi]], real(partner), None)],
                          recvs=[(flat[bounds[other[0]]:bounds[other[1]]], real(partner), None)])
            lo, hi = min(lo, other[0]), max(hi, other[1])
        else:
            comm.exchange("all-gather")
        distance *= 2
    if extra:
        if me < 2 * extra and me % 2 == 1:
            comm.exchange("unfold", sends=[(flat, me - 1, None)])
        elif me < 2 * extra:
            comm.exchange("unfold", recvs=[(flat, me + 1, None)])
        else:
            comm.exchange("unfold")


def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "ring",
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank ends with the reduction (sum, avg or max) of all ranks' tensors, in place.

    Per rank, for K ranks and N bytes: "naive" puts (K-1) x N through rank 0 in 2(K-1)
    steps; "tree" takes 2 ceil(log2 K) steps; "ring" sends 2(K-1)/K x N per rank in
    2(K-1) steps (bandwidth-optimal); "halving_doubling" sends the same volume in
    2 ceil(log2 K) steps.
    """
    _check_tensor(tensor)
    _check_op(op, tensor)
    _check_algorithm(algorithm, ALL_REDUCE_ALGORITHMS)
    comm = _Comm("all_reduce", group)
    _agree(comm, tensor, op, algorithm)
    if comm.size == 1:
        return _finish(tensor, _flat_work(tensor), op, 1)
    flat = _flat_work(tensor)
    comm.buffer = flat
    if algorithm in ROOTED_ALGORITHMS:
        _reduce_into(comm, flat, 0, op, algorithm)
        _broadcast_from(comm, flat, 0, algorithm)
    elif algorithm == "ring":
        # tensor_split, not padding: any N works, chunks differ by at most one element
        chunks = list(torch.tensor_split(flat, comm.size))
        _ring_reduce_scatter(comm, chunks, op)
        _ring_all_gather(comm, chunks)
    else:
        _halving_doubling(comm, flat, op)
    return _finish(tensor, flat, op, comm.size)
