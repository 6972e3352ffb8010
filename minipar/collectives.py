"""Every collective, written on point-to-point messages, with a meter.

Call these inside a rank (from `minipar.launch` or a Cluster). Each one moves data
only with `isend`/`irecv`; the algorithms are the ones a course on parallel
training draws:

- ``all_reduce(t, algorithm=...)``: "naive" (everyone sends to rank 0, which sends
  the result back), "tree" (binomial tree reduce, then broadcast), "ring"
  (reduce-scatter then all-gather, K-1 steps each) and "halving_doubling"
  (recursive halving reduce-scatter, recursive doubling all-gather).
- ``broadcast``, ``reduce`` ("naive" or "tree"), ``scatter``, ``gather``,
  ``all_gather`` (ring), ``reduce_scatter`` (ring) and ``all_to_all``.

How sends and receives are paired (deadlock-free on gloo and NCCL): every step
posts all of its sends and receives together in one `batch_isend_irecv` and waits
on every request before the next step. Ranks never block in a send while their
peer blocks in a send.

Chunks are those of ``torch.tensor_split(t, world_size)``: along dim 0 for
scatter / reduce_scatter / all_to_all, over the flattened tensor inside all_reduce.
Empty chunks are not sent. Long chunks travel in segments of SEGMENT_BYTES, and a
receiving rank reduces each segment as soon as it lands while later ones are still
in flight.

Checks: arguments are checked on every rank before any message is sent. With
validation on (the default, see `validation`) the ranks also compare shapes,
dtypes and arguments with one small all-gather of metadata (not metered, not part
of the algorithm) and all raise the same ValueError if they disagree, instead of
hanging or returning garbage.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import trace

OPS = ("sum", "avg", "max")
ALL_REDUCE_ALGORITHMS = ("naive", "tree", "ring", "halving_doubling")
ROOTED_ALGORITHMS = ("naive", "tree")
SEGMENT_BYTES = 1 << 20  # ring segments: small enough to overlap, large enough to stream

_meters: list[Meter] = []
_validate = True


# ------------------------------------------------------------------- the meter ---

@dataclass
class Transfer:
    """One message this rank sent or received."""

    collective: str
    phase: str
    step: int
    direction: str  # "send" or "recv"
    peer: int
    chunk: int | None
    bytes: int


@dataclass
class Meter:
    """This rank's traffic inside a `meter()` block."""

    sent_bytes: int = 0
    recv_bytes: int = 0
    messages: int = 0  # messages sent (a segmented chunk counts once per segment)
    steps: int = 0  # communication steps this rank took part in
    transfers: list[Transfer] = field(default_factory=list)
    keep_snapshots: bool = False
    snapshots: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)  # collective name -> times called


@contextmanager
def meter(snapshots: bool = False) -> Iterator[Meter]:
    """Count this rank's sent/received bytes, messages and steps inside the block.

    With `snapshots=True` the meter also keeps a copy of the working buffer after
    every step (what the animator draws); use it with small tensors.
    """
    m = Meter(keep_snapshots=snapshots)
    _meters.append(m)
    try:
        yield m
    finally:
        _meters.remove(m)


@contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Switch the cross-rank shape/argument handshake on or off inside the block."""
    global _validate
    previous, _validate = _validate, enabled
    try:
        yield
    finally:
        _validate = previous


# ------------------------------------------------------------ point to point ---

class _Comm:
    """One collective call on one rank: its group, its step counter, its messages."""

    def __init__(self, name: str, group: dist.ProcessGroup | None) -> None:
        self.name, self.group = name, group
        for m in _meters:
            m.calls[name] = m.calls.get(name, 0) + 1
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.step = 0
        self.buffer: torch.Tensor | None = None  # what snapshots copy

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def exchange(self, phase: str, sends: list[tuple[torch.Tensor, int, int | None]] = (),
                 recvs: list[tuple[torch.Tensor, int, int | None]] = (),
                 on_arrival: Callable[[int, int, int], None] | None = None) -> None:
        """One step: post every send (tensor, peer, chunk) and receive, then wait for all.

        Tensors longer than SEGMENT_BYTES go in segments; `on_arrival(i, start, end)`
        runs for receive i's elements [start, end) as soon as they land.
        """
        sends = [s for s in sends if s[0].numel()]
        recvs = [r for r in recvs if r[0].numel()]
        ops, send_meta, recv_meta = [], [], []
        for tensor, peer, chunk in sends:
            for tag, (a, b) in enumerate(_segments(tensor)):
                ops.append(dist.P2POp(dist.isend, tensor[a:b], self.global_rank(peer),
                                      self.group, tag))
                send_meta.append((peer, chunk, (b - a) * tensor.element_size()))
        first_recv = len(ops)
        for index, (tensor, peer, chunk) in enumerate(recvs):
            for tag, (a, b) in enumerate(_segments(tensor)):
                ops.append(dist.P2POp(dist.irecv, tensor[a:b], self.global_rank(peer),
                                      self.group, tag))
                recv_meta.append((index, a, b, peer, chunk, (b - a) * tensor.element_size()))
        if ops:
            start = trace.now()
            requests = dist.batch_isend_irecv(ops)
            for request, (index, a, b, peer, chunk, nbytes) in zip(
                    requests[first_recv:], recv_meta, strict=True):
                request.wait()
                end = trace.now()
                self._note("recv", phase, peer, chunk, nbytes, start, end)
                if on_arrival is not None:
                    on_arrival(index, a, b)
            for request, (peer, chunk, nbytes) in zip(requests[:first_recv], send_meta,
                                                      strict=True):
                request.wait()
                self._note("send", phase, peer, chunk, nbytes, start, trace.now())
        for m in _meters:
            if ops:
                m.steps += 1
            if m.keep_snapshots and self.buffer is not None:
                m.snapshots.append((phase, self.step, self.buffer.detach().clone()))
        self.step += 1

    def _note(self, direction: str, phase: str, peer: int, chunk: int | None, nbytes: int,
              start: float, end: float) -> None:
        _account(Transfer(self.name, phase, self.step, direction, peer, chunk, nbytes),
                 start, end)


def _account(transfer: Transfer, start: float, end: float, messages: int = 1) -> None:
    """Every message minipar moves: into every open meter, and into the Timeline."""
    for m in _meters:
        if transfer.direction == "send":
            m.sent_bytes += transfer.bytes
            m.messages += messages
        else:
            m.recv_bytes += transfer.bytes
        m.transfers.append(transfer)
    trace.add_event(transfer.direction, f"{transfer.collective} {transfer.phase}", start, end,
                    peer=transfer.peer, bytes=transfer.bytes, step=transfer.step,
                    chunk=transfer.chunk)


def _segments(flat: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) element ranges of at most SEGMENT_BYTES each (the same on both ends)."""
    per = max(SEGMENT_BYTES // max(flat.element_size(), 1), 1)
    n = flat.numel()
    return [(a, min(a + per, n)) for a in range(0, n, per)] or [(0, 0)]


# ------------------------------------------------------------------ checking ---

def _check_op(op: str, tensor: torch.Tensor) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}; got {op!r}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='avg' needs a floating-point tensor (got {tensor.dtype}); "
                         "use op='sum' and divide yourself, or convert with .float()")


def _check_algorithm(algorithm: str, allowed: tuple[str, ...]) -> None:
    if algorithm not in allowed:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, allowed))}; "
                         f"got {algorithm!r}")


def _check_root(name: str, root: int, size: int) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"{name} must be a rank in 0..{size - 1}; got {root!r}")


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor; got {type(tensor).__name__}")
    if tensor.dtype == torch.bool:
        raise ValueError("bool tensors are not supported; convert with .to(torch.uint8)")


_CODES = {name: i for i, name in enumerate(OPS + ALL_REDUCE_ALGORITHMS + ("-",))}


def _agree(comm: _Comm, tensor: torch.Tensor, op: str = "-", algorithm: str = "-",
           root: int = -1, dim0_may_differ: bool = False) -> None:
    """Every rank checks that all ranks called with matching tensors and arguments."""
    if not _validate or comm.size == 1:
        return
    shape = list(tensor.shape)
    if dim0_may_differ and shape:
        shape[0] = -1
    if len(shape) > 8:
        raise ValueError(f"{comm.name}: tensors with more than 8 dimensions are not supported; "
                         "reshape to fewer first")
    meta = [len(shape), *shape, *([0] * (8 - len(shape))), zlib.crc32(str(tensor.dtype).encode()),
            _CODES[op], _CODES[algorithm], root]
    mine = torch.tensor(meta, dtype=torch.int64, device=tensor.device)
    everyone = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(everyone, mine, group=comm.group)
    rows = [row.tolist() for row in everyone]
    if all(row == rows[0] for row in rows):
        return
    shapes = {r: tuple(row[1:1 + row[0]]) for r, row in enumerate(rows)}
    if len(set(shapes.values())) > 1:
        detail = ", ".join(f"rank {r} has {s}" for r, s in shapes.items())
        what = "trailing dimensions" if dim0_may_differ else "shapes"
        raise ValueError(f"{comm.name}: tensor {what} differ across ranks ({detail}); every "
                         "rank must pass a tensor of the same shape")
    raise ValueError(f"{comm.name}: ranks disagree on dtype, op, algorithm or root; every rank "
                     "must call it with the same arguments")


def split_bounds(n: int, parts: int) -> list[int]:
    """Start offsets (and the end) of torch.tensor_split(range(n), parts)'s pieces."""
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


_scratch_buffers: dict[tuple, torch.Tensor] = {}


def _scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A reusable receive buffer: fresh pages for every call cost page faults on big tensors."""
    key = (like.dtype, like.device)
    buffer = _scratch_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        _scratch_buffers[key] = buffer
    return buffer[:numel]


def _combine(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    if op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:  # sum, and avg (divided once at the end)
        acc.add_(incoming)


def _reduce_as_it_lands(targets: list[torch.Tensor], incoming: list[torch.Tensor],
                        op: str) -> Callable[[int, int, int], None]:
    """An on_arrival callback: combine receive i's landed segment into targets[i]."""
    def combine(i: int, a: int, b: int) -> None:
        _combine(targets[i][a:b], incoming[i][a:b], op)

    return combine


def _flat_work(tensor: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous working view (a copy only if the tensor is not contiguous)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _finish(tensor: torch.Tensor, flat: torch.Tensor, op: str, size: int) -> torch.Tensor:
    if op == "avg":
        flat.div_(size)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# ------------------------------------------------------- rooted: trees and stars ---

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
    relative = (me - dst) % size
    for i in range(math.ceil(math.log2(size))):  # binomial tree: ceil(log2 K) rounds
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

    "tree": a binomial tree, ceil(log2 K) rounds, each holder sends once per round.
    "naive": the root sends to every other rank itself, K-1 rounds.
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

    "tree": binomial tree, ceil(log2 K) rounds; "naive": `dst` receives from each rank
    in turn, K-1 rounds and (K-1) x N bytes into one node.
    """
    _check_tensor(tensor)
    _check_op(op, tensor)
    _check_algorithm(algorithm, ROOTED_ALGORITHMS)
    comm = _Comm("reduce", group)
    _check_root("dst", dst, comm.size)
    _agree(comm, tensor, op, algorithm, dst)
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
        chunks = [c.contiguous() for c in torch.tensor_split(tensor, comm.size)]
        comm.exchange("scatter", sends=[(c.view(-1), r, r) for r, c in enumerate(chunks)
                                        if r != src])
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


# ------------------------------------------------------------------- rings ---

def _ring_reduce_scatter(comm: _Comm, chunks: list[torch.Tensor], op: str) -> None:
    """K-1 steps; at step s rank r passes chunk r-s-1 right and reduces chunk r-s-2 from
    the left, so rank r ends holding the full reduction of chunk r."""
    size, me = comm.size, comm.rank
    right, left = (me + 1) % size, (me - 1) % size
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
    out[comm.rank] = piece
    comm.buffer = out
    _ring_all_gather(comm, [out[r].view(-1) for r in range(comm.size)])
    return out.reshape(comm.size * piece.shape[0], *piece.shape[1:]) if piece.dim() else out


def reduce_scatter(tensor: torch.Tensor, op: str = "sum",
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank r gets chunk r (tensor_split along dim 0) of the reduction of all ranks' tensors."""
    _check_tensor(tensor)
    _check_op(op, tensor)
    comm = _Comm("reduce_scatter", group)
    _agree(comm, tensor, op)
    work = tensor.detach().clone().contiguous()
    comm.buffer = work
    chunks = [c.reshape(-1) for c in torch.tensor_split(work, comm.size)]
    if comm.size > 1:
        _ring_reduce_scatter(comm, chunks, op)
    mine = torch.tensor_split(work, comm.size)[comm.rank].clone()
    if op == "avg":
        mine.div_(comm.size)
    return mine


# ------------------------------------------------------ recursive halving/doubling ---

def _halving_doubling(comm: _Comm, flat: torch.Tensor, op: str) -> None:
    """Rabenseifner's all-reduce. With K not a power of two, the first 2R ranks
    (R = K - P, P the largest power of two <= K) fold in pairs first and are sent the
    result at the end: one extra step each way, so still ceil(log2 K) steps per phase."""
    size, me = comm.size, comm.rank
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    incoming = _scratch(flat, flat.numel())

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
            comm.exchange("fold")
            virtual = me - extra
    else:
        virtual = me
    bounds = split_bounds(flat.numel(), p)
    lo, hi = 0, p
    distance = p // 2
    while distance >= 1:  # halving: keep half the range, send the other half
        if virtual >= 0:
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
        chunks = list(torch.tensor_split(flat, comm.size))
        _ring_reduce_scatter(comm, chunks, op)
        _ring_all_gather(comm, chunks)
    else:
        _halving_doubling(comm, flat, op)
    return _finish(tensor, flat, op, comm.size)


# ------------------------------------------------------------- point to point ---

def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send `tensor` to rank `dst` (metered, and an event in the Timeline)."""
    _check_tensor(tensor)
    comm = _Comm("send", group)
    _check_root("dst", dst, comm.size)
    comm.exchange("p2p", sends=[(tensor.contiguous().view(-1), dst, None)])


class PendingSend:
    """A send in flight; `wait()` blocks until the data has left, then meters it."""

    def __init__(self, works: list, tensor: torch.Tensor, dst: int, start: float) -> None:
        self.works, self.tensor, self.dst, self.start = works, tensor, dst, start

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        nbytes = self.tensor.numel() * self.tensor.element_size()
        _account(Transfer("isend", "p2p", 0, "send", self.dst, None, nbytes), self.start,
                 trace.now(), messages=len(self.works))


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> PendingSend:
    """Start sending `tensor` to `dst` without waiting (pipelines need it: with blocking
    sends, two stages that each send before receiving deadlock). Keep `tensor` unchanged
    and call `.wait()` on the result before reusing it."""
    _check_tensor(tensor)
    size = dist.get_world_size(group)
    _check_root("dst", dst, size)
    data = tensor.contiguous().view(-1)
    peer = dst if group is None else dist.get_global_rank(group, dst)
    # the same segments and tags as exchange(), so a plain recv() on the other side matches
    works = [dist.isend(data[a:b], peer, group, tag) for tag, (a, b) in enumerate(_segments(data))
             if b > a]
    return PendingSend(works, data, dst, trace.now())


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into `tensor` from rank `src` (metered); returns `tensor`."""
    _check_tensor(tensor)
    comm = _Comm("recv", group)
    _check_root("src", src, comm.size)
    flat = _flat_work(tensor)
    comm.exchange("p2p", recvs=[(flat, src, None)])
    return _finish(tensor, flat, "sum", 1)


def recv_any(tensor: torch.Tensor) -> int:
    """Receive into `tensor` from whichever rank sends first; returns that rank (gloo only:
    NCCL has no receive-from-any). Metered as one message of tensor's size."""
    _check_tensor(tensor)
    start = trace.now()
    source = dist.recv(tensor)
    _account(Transfer("recv_any", "p2p", 0, "recv", source, None,
                      tensor.numel() * tensor.element_size()), start, trace.now())
    for m in _meters:
        m.steps += 1
    return source


# ---------------------------------------------------------------- all-to-all ---

def all_to_all(tensor: torch.Tensor, send_counts: list[int] | None = None,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Piece j of this rank's tensor (along dim 0) goes to rank j; returns the pieces
    received, concatenated in source-rank order.

    `send_counts[j]` rows go to rank j (default: tensor_split's even pieces). Ranks
    first swap their counts (one small message per pair, metered as phase "counts"),
    then the pieces, all in one step.
    """
    _check_tensor(tensor)
    comm = _Comm("all_to_all", group)
    if tensor.dim() == 0:
        raise ValueError("all_to_all needs a tensor with at least one dimension")
    rows = tensor.shape[0]
    if send_counts is None:
        send_counts = [p.shape[0] for p in torch.tensor_split(tensor, comm.size)]
    elif (len(send_counts) != comm.size or any(isinstance(c, bool) or not isinstance(c, int)
                                               or c < 0 for c in send_counts)
          or sum(send_counts) != rows):
        raise ValueError(f"send_counts must be {comm.size} non-negative ints (one per rank) "
                         f"summing to tensor.shape[0]={rows}; got {send_counts!r}")
    _agree(comm, tensor, dim0_may_differ=True)
    counts_out = torch.tensor(send_counts, dtype=torch.int64, device=tensor.device)
    counts_in = torch.zeros_like(counts_out)
    counts_in[comm.rank] = counts_out[comm.rank]
    others = [r for r in range(comm.size) if r != comm.rank]
    comm.exchange("counts", sends=[(counts_out[r:r + 1], r, r) for r in others],
                  recvs=[(counts_in[r:r + 1], r, r) for r in others])
    pieces = torch.split(tensor.contiguous(), send_counts)
    tail = tuple(tensor.shape[1:])
    received = [torch.empty((int(n), *tail), dtype=tensor.dtype, device=tensor.device)
                for n in counts_in.tolist()]
    received[comm.rank].copy_(pieces[comm.rank])
    comm.exchange("exchange", sends=[(pieces[r].reshape(-1), r, r) for r in others],
                  recvs=[(received[r].view(-1), r, r) for r in others])
    return torch.cat(received)


# ------------------------------------------------------------------ demo run ---

def _demo(numel: int) -> list[str]:
    """Every all-reduce algorithm against torch's own, with this rank's metered traffic."""
    from .runtime import device, rank

    lines = []
    for algorithm in ALL_REDUCE_ALGORITHMS:
        mine = torch.arange(numel, dtype=torch.float64, device=device()) * (rank() + 1)
        expected = mine.clone()
        dist.all_reduce(expected)
        with meter() as m:
            all_reduce(mine, algorithm=algorithm)
        lines.append(f"{algorithm:17} matches torch: {torch.equal(mine, expected)}, "
                     f"sent {m.sent_bytes} B in {m.steps} steps")
    return lines


def main(argv: list[str] | None = None) -> None:
    """python -m minipar.collectives --ranks 4, or under torchrun (NCCL on GPUs)."""
    from .runtime import demo_parser, launch, rank

    parser = demo_parser("minipar's all-reduce algorithms vs torch's", 4)
    parser.add_argument("--numel", type=int, default=1 << 16)
    args = parser.parse_args(argv)
    results = launch(_demo, args.ranks, args.numel, backend=args.backend)
    if rank() == 0:
        for r, lines in enumerate(results):
            for line in lines:
                print(f"rank {r}: {line}")


if __name__ == "__main__":
    main()
