"""The messaging layer every collective is written on: one step posts all its sends and
receives together and waits for all of them; every message is metered and becomes an
event in the Timeline; arguments are checked on every rank before anything moves."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import trace
from ..runtime.progress import beat
from .host_staging import post, wire_device
from .network import pay_for_sends

OPS = ("sum", "avg", "max")
ALL_REDUCE_ALGORITHMS = ("naive", "tree", "ring", "halving_doubling")
ROOTED_ALGORITHMS = ("naive", "tree", "binary")
SEGMENT_BYTES = 1 << 20  # ring segments: small enough to overlap, large enough to stream

_meters: list[Meter] = []
_validation = threading.local()  # per thread: a communication thread sets its own
_every_thread = {"enabled": True}  # every thread's, unless it set its own


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
def validation(enabled: bool, every_thread: bool = False) -> Iterator[None]:
    """Switch the cross-rank shape/argument handshake on or off inside the block: for the
    calling thread, or with `every_thread` for every thread of this process that has not
    set its own (a trainer's communication threads, which run its collectives for it)."""
    # a thread's own setting lives in its threading.local; the process's in _every_thread
    store = _every_thread if every_thread else _validation.__dict__
    had, previous = "enabled" in store, store.get("enabled")
    store["enabled"] = enabled
    try:
        yield
    finally:
        if had:
            store["enabled"] = previous
        else:  # the thread follows the process's setting again
            del store["enabled"]


def validating() -> bool:
    """Whether the cross-rank handshake is on in this thread (see `validation`)."""
    return _validation.__dict__.get("enabled", _every_thread["enabled"])


# ------------------------------------------------------------------- one step ---

class _Comm:
    """One collective call on one rank: its group, its step counter, its messages."""

    def __init__(self, name: str, group: dist.ProcessGroup | None, label: str | None = None,
                 **fields: int) -> None:
        self.name, self.group = name, group
        self.label, self.fields = label, fields  # what the Timeline calls this call's messages
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
        # tensor_split leaves empty chunks when a tensor has fewer elements than ranks: skip them
        sends = [s for s in sends if s[0].numel()]
        recvs = [r for r in recvs if r[0].numel()]
        if any(t.is_meta for t, _, _ in (*sends, *recvs)):
            # a dry run builds on the meta device (train/dry_run.py): no values, nothing to send
            return
        ops, send_meta, recv_meta = [], [], []
        for tensor, peer, chunk in sends:
            # tag = segment index: both ends cut the same segments, so segment j meets segment j
            for tag, (a, b) in enumerate(_segments(tensor, self.group)):
                ops.append(dist.P2POp(dist.isend, tensor[a:b], self.global_rank(peer),
                                      self.group, tag))
                send_meta.append((peer, chunk, (b - a) * tensor.element_size()))
        first_recv = len(ops)  # requests come back in ops order: sends first, then receives
        for index, (tensor, peer, chunk) in enumerate(recvs):
            for tag, (a, b) in enumerate(_segments(tensor, self.group)):
                ops.append(dist.P2POp(dist.irecv, tensor[a:b], self.global_rank(peer),
                                      self.group, tag))
                recv_meta.append((index, a, b, peer, chunk, (b - a) * tensor.element_size()))
        if ops:
            start = trace.now()
            # the emulated network (network.py) charges the sender before its messages are posted
            pay_for_sends((self.global_rank(peer), nbytes) for peer, _, nbytes in send_meta)
            # all sends and receives posted at once: two ranks that send to each other cannot
            # deadlock, as they would with a blocking send before a blocking recv (NCCL runs them as
            # one group)
            requests = post(ops)  # through host memory where gloo meets a GPU tensor
            for request, (index, a, b, peer, chunk, nbytes) in zip(
                    requests[first_recv:], recv_meta, strict=True):
                # receives first, in order: on_arrival reduces early segments while later ones are
                # in flight
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
                # clone: later steps overwrite the buffer in place; this keeps the state after this
                # step
                m.snapshots.append((phase, self.step, self.buffer.detach().clone()))
        self.step += 1

    def _note(self, direction: str, phase: str, peer: int, chunk: int | None, nbytes: int,
              start: float, end: float, step: int | None = None) -> None:
        """Meter one message of this call, at `step` (default: the current one)."""
        _account(Transfer(self.name, phase, self.step if step is None else step, direction,
                          peer, chunk, nbytes), start, end, label=self.label, **self.fields)


def _account(transfer: Transfer, start: float, end: float, messages: int = 1,
             label: str | None = None, **fields: int) -> None:
    """Every message minipar moves: into every open meter, and into the Timeline (labelled
    "collective phase" unless the caller names it, as the pipeline engine does: 1SEND_F0)."""
    beat()  # progress, for the launcher's watchdog (runtime/progress.py)
    for m in _meters:
        if transfer.direction == "send":
            m.sent_bytes += transfer.bytes
            m.messages += messages
        else:
            m.recv_bytes += transfer.bytes
        m.transfers.append(transfer)
    trace.add_event(transfer.direction, label or f"{transfer.collective} {transfer.phase}",
                    start, end, peer=transfer.peer, bytes=transfer.bytes, step=transfer.step,
                    chunk=transfer.chunk, **fields)


def _segments(flat: torch.Tensor, group: dist.ProcessGroup | None = None
              ) -> list[tuple[int, int]]:
    """[start, end) element ranges of at most SEGMENT_BYTES each (the same on both ends).
    Under NCCL one range: a batch is one NCCL group that returns one request, so segments
    could not be waited for one by one, and 1 MiB pieces of a 1 GiB bucket would be 1,024
    operations in one group for nothing."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return [(0, flat.numel())]
    per = max(SEGMENT_BYTES // max(flat.element_size(), 1), 1)
    n = flat.numel()
    # an empty tensor still yields one (empty) range; callers drop it with `if b > a`
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


# names as small ints for the int64 handshake; dict.fromkeys drops the repeats ("naive" and
# "tree" are in two lists) and keeps the order, so every rank derives the same codes
_CODES = {name: i for i, name in enumerate(
    dict.fromkeys(OPS + ALL_REDUCE_ALGORITHMS + ROOTED_ALGORITHMS + ("-",)))}


def _agree(comm: _Comm, tensor: torch.Tensor, op: str = "-", algorithm: str = "-",
           root: int = -1, dim0_may_differ: bool = False) -> None:
    """Every rank checks that all ranks called with matching tensors and arguments."""
    if not validating() or comm.size == 1:
        return
    shape = list(tensor.shape)
    if dim0_may_differ and shape:
        # all_to_all's pieces may have different numbers of rows on different ranks
        shape[0] = -1
    # all_gather needs one size on every rank: shapes are padded to 8 dimensions
    if len(shape) > 8:
        raise ValueError(f"{comm.name}: tensors with more than 8 dimensions are not supported; "
                         "reshape to fewer first")
    # crc32, not hash(): Python salts str hashes per process, so ranks would disagree
    meta = [len(shape), *shape, *([0] * (8 - len(shape))), zlib.crc32(str(tensor.dtype).encode()),
            _CODES[op], _CODES[algorithm], root]
    mine = torch.tensor(meta, dtype=torch.int64, device=wire_device(tensor, comm.group))
    everyone = [torch.empty_like(mine) for _ in range(comm.size)]
    # torch's own collective, not minipar's: the handshake is neither metered nor traced
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


# ------------------------------------------------------------ working buffers ---

def split_bounds(n: int, parts: int) -> list[int]:
    """Start offsets (and the end) of torch.tensor_split(range(n), parts)'s pieces."""
    # torch.tensor_split's rounding: the first n % parts pieces get one element more
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


# one per (dtype, device) and thread, grown when too small; a call must be done with it
# before the next on its thread. Per thread: a data-parallel communication thread runs
# collectives while the main thread runs tensor parallelism's, and one shared buffer mixed
# their sums
_scratch_buffers = threading.local()


def _scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A reusable receive buffer: fresh pages for every call cost page faults on big tensors."""
    mine = _scratch_buffers.__dict__  # this thread's buffers (gone with the thread)
    key = (like.dtype, like.device)
    buffer = mine.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        mine[key] = buffer
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
    # a view when possible, so the collective works in place on the caller's memory
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _finish(tensor: torch.Tensor, flat: torch.Tensor, op: str, size: int) -> torch.Tensor:
    if op == "avg":
        flat.div_(size)
    # copy back only when `flat` was a copy (the input was not contiguous)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
