"""Rooted collectives: broadcast and reduce as a star ("naive": the root talks to one
rank at a time), a binomial tree ("tree") or a binary tree ("binary"); scatter and gather."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import (
    ROOTED_ALGORITHMS,
    _agree,
    _check_algorithm,
    _check_op,
    _check_root,
    _check_tensor,
    _Comm,
    _finish,
    _flat_work,
    _reduce_as_it_lands,
    _scratch,
)


def _binary_rounds(size: int) -> list[list[tuple[int, int]]]:
    """A binary tree in heap order (rank r's children are 2r+1 and 2r+2, counted from the
    root): one round per level, each a list of (parent, child) links."""
    rounds, first, width = [], 0, 1
    while True:
        pairs = [(p, c) for p in range(first, min(first + width, size))
                 for c in (2 * p + 1, 2 * p + 2) if c < size]
        if not pairs:
            return rounds
        rounds.append(pairs)
        first, width = first + width, 2 * width


def _reduce_into(comm: _Comm, flat: torch.Tensor, dst: int, op: str, algorithm: str) -> None:
    """Reduce every rank's `flat` into `flat` on `dst` (other ranks' `flat` is scratch)."""
    size, me = comm.size, comm.rank
    comm.buffer = flat
    incoming = _scratch(flat, flat.numel())
    if algorithm == "naive":
        for src in range(size):  # the root takes one rank at a time: K-1 steps
            if src == dst:
                continue
            if me == dst:
                comm.exchange("reduce", recvs=[(incoming, src, None)],
                              on_arrival=_reduce_as_it_lands([flat], [incoming], op))
            elif me == src:
                comm.exchange("reduce", sends=[(flat, dst, None)])
            else:
                comm.exchange("reduce")
        return
    # ranks renumbered so the root is 0: the tree shapes below are written for root 0
    relative = (me - dst) % size
    if algorithm == "binary":  # leaves first: each parent adds its (up to) two children
        # two receive rows: both children's tensors may land in the same step
        pair = _scratch(flat, 2 * flat.numel()).view(2, -1)
        for links in reversed(_binary_rounds(size)):
            children = [c for p, c in links if p == relative]
            parent = [p for p, c in links if c == relative]
            comm.exchange("reduce", sends=[(flat, (q + dst) % size, None) for q in parent],
                          recvs=[(pair[i], (c + dst) % size, None)
                                 for i, c in enumerate(children)],
                          on_arrival=_reduce_as_it_lands([flat, flat], list(pair), op))
        return
    for i in range(math.ceil(math.log2(size))):  # binomial tree: ceil(log2 K) rounds
        # the child at distance m sends its partial sum up to its parent and drops out
        m = 1 << i
        if relative % (2 * m) == m:
            comm.exchange("reduce", sends=[(flat, (relative - m + dst) % size, None)])
        elif relative % (2 * m) == 0 and relative + m < size:
            comm.exchange("reduce", recvs=[(incoming, (relative + m + dst) % size, None)],
                          on_arrival=_reduce_as_it_lands([flat], [incoming], op))
        else:
            comm.exchange("reduce")


def _broadcast_from(comm: _Comm, flat: torch.Tensor, src: int, algorithm: str) -> None:
    size, me = comm.size, comm.rank
    comm.buffer = flat
    if algorithm == "naive":
        for dst in range(size):  # the root sends to one rank at a time: K-1 steps
            if dst == src:
                continue
            if me == src:
                comm.exchange("broadcast", sends=[(flat, dst, None)])
            elif me == dst:
                comm.exchange("broadcast", recvs=[(flat, src, None)])
            else:
                comm.exchange("broadcast")
        return
    relative = (me - src) % size
    if algorithm == "binary":  # root first: each holder sends to its (up to) two children
        for links in _binary_rounds(size):
            comm.exchange("broadcast",
                          sends=[(flat, (c + src) % size, None) for p, c in links
                                 if p == relative],
                          recvs=[(flat, (p + src) % size, None) for p, c in links
                                 if c == relative])
        return
    # the reduce's rounds in reverse: the biggest jump first, each holder doubling the holders
    for i in reversed(range(math.ceil(math.log2(size)))):
        m = 1 << i
        if relative % (2 * m) == 0 and relative + m < size:
            comm.exchange("broadcast", sends=[(flat, (relative + m + src) % size, None)])
        elif relative % (2 * m) == m:
            comm.exchange("broadcast", recvs=[(flat, (relative - m + src) % size, None)])
        else:
            comm.exchange("broadcast")


def broadcast(tensor: torch.Tensor, src: int = 0, algorithm: str = "tree",
              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy `src`'s tensor into every rank's tensor (in place; returns it).

    "tree": a binomial tree, ceil(log2 K) rounds, each holder sends once per round (the
    root sends ceil(log2 K) times). "binary": a binary tree, floor(log2 K) rounds, no rank
    sends more than twice whatever K is. "naive": the root sends to every rank itself.
    """
    _check_tensor(tensor)
    _check_algorithm(algorithm, ROOTED_ALGORITHMS)
    comm = _Comm("broadcast", group)
    _check_root("src", src, comm.size)
    _agree(comm, tensor, algorithm=algorithm, root=src)
    if comm.size > 1:
        flat = _flat_work(tensor)
        _broadcast_from(comm, flat, src, algorithm)
        _finish(tensor, flat, "sum", comm.size)
    return tensor


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", algorithm: str = "tree",
           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Combine every rank's tensor into `dst`'s tensor (in place; others are left unchanged).

    "tree": binomial tree, ceil(log2 K) rounds; "binary": binary tree, floor(log2 K)
    rounds, no rank receives more than two tensors; "naive": `dst` receives from each rank
    in turn, K-1 rounds and (K-1) x N bytes into one node.
    """
    _check_tensor(tensor)
    _check_op(op, tensor)
    _check_algorithm(algorithm, ROOTED_ALGORITHMS)
    comm = _Comm("reduce", group)
    _check_root("dst", dst, comm.size)
    _agree(comm, tensor, op, algorithm, dst)
    # off the root, a copy: partial sums land in it, and the caller's tensor stays unchanged
    flat = _flat_work(tensor) if comm.rank == dst else tensor.detach().reshape(-1).clone()
    if comm.size > 1:
        _reduce_into(comm, flat, dst, op, algorithm)
    if comm.rank == dst:
        _finish(tensor, flat, op, comm.size)
    return tensor


def scatter(tensor: torch.Tensor, src: int = 0,
            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank r gets chunk r of `src`'s tensor (tensor_split along dim 0), in one step.

    Every rank passes a tensor of the full shape; only `src`'s contents matter.
    """
    _check_tensor(tensor)
    comm = _Comm("scatter", group)
    _check_root("src", src, comm.size)
    _agree(comm, tensor, root=src)
    if comm.rank == src:
        # contiguous: a dim-0 piece of a contiguous tensor already is, but not of a strided one
        chunks = [c.contiguous() for c in torch.tensor_split(tensor, comm.size)]
        comm.exchange("scatter", sends=[(c.view(-1), r, r) for r, c in enumerate(chunks)
                                        if r != src])
        # clone: the root's own chunk must not be a view into the caller's tensor
        return chunks[src].clone()
    mine = torch.empty_like(torch.tensor_split(tensor, comm.size)[comm.rank])
    comm.exchange("scatter", recvs=[(mine.view(-1), src, comm.rank)])
    return mine


def gather(tensor: torch.Tensor, dst: int = 0,
           group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """`dst` gets every rank's tensor concatenated along dim 0 in rank order; others get None."""
    _check_tensor(tensor)
    comm = _Comm("gather", group)
    _check_root("dst", dst, comm.size)
    _agree(comm, tensor, root=dst)
    piece = tensor.contiguous()
    if comm.rank != dst:
        comm.exchange("gather", sends=[(piece.view(-1), dst, comm.rank)])
        return None
    out = torch.empty((comm.size, *piece.shape), dtype=piece.dtype, device=piece.device)
    out[dst] = piece
    comm.exchange("gather", recvs=[(out[r].view(-1), r, r) for r in range(comm.size)
                                   if r != dst])
    return out.reshape(comm.size * piece.shape[0], *piece.shape[1:]) if piece.dim() else out
