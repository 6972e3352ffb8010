"""The message log: what one rank asked of the network, in order, for the NCCL replay.

Inside `recording()` a rank notes, as it runs on gloo:
- every batch `dist.batch_isend_irecv` sends off (each message's direction, peer, group
  and size: `host_staging.post` posts all of minipar's this way), and every message
  `dist.isend`/`irecv`/`send`/`recv` posts on its own, which NCCL treats differently
  (collectives/nccl_replay.py says how);
- each `wait()` on a request;
- torch's own collectives (`all_reduce`, `barrier`, the object collectives, ...);
- host syncs: `.item()`, `.tolist()`, `bool()`, `int()`, `float()`, `.numpy()` and copies
  to the host. On a GPU these block the host until the rank's stream has done its work.
  On the faked device (runtime/faked_device.py) only its tensors count; on a CPU every
  tensor is on the host, so every such call counts (the safe side).

Each entry carries the thread that made it (a communication thread stands for a CUDA
stream of its own) and the minipar line that asked for it: the first frame outside
the messaging layer, "pipeline/messages.py:91". `replay()` in nccl_replay.py takes
one such log per rank.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

from ..runtime.device import on_accelerator

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# the messaging layer: a line here says less than the line that called it
_LAYER = {os.path.join(PACKAGE, "collectives", f) for f in
          ("p2p.py", "comm.py", "host_staging.py", "message_log.py")}
TORCH_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all",
                     "all_to_all_single", "barrier", "all_gather_object", "gather_object",
                     "broadcast_object_list", "scatter_object_list", "gather", "scatter")
# collectives that end in a host sync: the object ones read sizes on the host; NCCL's
# barrier synchronizes the device
_SYNCING = {"barrier", "all_gather_object", "gather_object", "broadcast_object_list",
            "scatter_object_list"}
_SKIPPED = (os.path.dirname(torch.__file__), os.path.join(PACKAGE, "runtime"))
_UNBATCHED = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}
_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.numpy}


@dataclass(frozen=True)
class LoggedMessage:
    """One message of a posting: "send" or "recv", the peer's global rank, bytes."""

    direction: str
    peer: int
    nbytes: int


@dataclass(frozen=True)
class Entry:
    """One thing a rank did: "post" (messages, batched or not), "collective" (name),
    "wait" (a request), "sync" (the host waits for the device), or "publish" and
    "await" (a key made known, and a wait until it is: see `note`)."""

    kind: str
    thread: str
    where: str
    group: tuple[int, ...] = ()  # the group's global ranks
    messages: tuple[LoggedMessage, ...] = ()
    batched: bool = True
    name: str = ""
    request: int = -1  # a post's or collective's id; a wait's target


def where() -> str:
    """The innermost line outside the messaging layer, torch and the launcher's runtime:
    a minipar line ("pipeline/messages.py:91"), or a test's or a learner's."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        skip = name in _LAYER or name.startswith(_SKIPPED) or "contextlib" in name \
            or "threading" in name
        if not skip:
            return f"{name[len(PACKAGE):] if name.startswith(PACKAGE) else name}:" \
                   f"{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


class _Waited:
    """A request whose `wait()` is logged."""

    def __init__(self, log: MessageLog, work, request: int) -> None:
        self.log, self.work, self.request = log, work, request

    def wait(self, *args) -> bool:
        self.log.add("wait", request=self.request)
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self.work, name)


class MessageLog(TorchFunctionMode):
    """The entries of one rank, in the order its threads made them."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Entry] = []
        self._lock = threading.Lock()
        self._depth = threading.local()  # inside a logged collective: its inner calls are its own

    def add(self, kind: str, **fields) -> int:
        with self._lock:
            self.entries.append(Entry(kind, threading.current_thread().name, where(), **fields))
            return len(self.entries) - 1

    def inside(self) -> bool:
        return getattr(self._depth, "n", 0) > 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNCS and not self.inside() and _on_device(args):
            self.add("sync", name=func.__name__)
        elif func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(args, kwargs)):
            if not self.inside() and _on_device(args):
                self.add("sync", name="copy to host")
        return func(*args, **(kwargs or {}))

    def wrap_collective(self, name: str, fn):
        @functools.wraps(fn)
        def logged(*args, **kwargs):
            if self.inside():
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            request = self.add("collective", group=_ranks(group), name=name)
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                work = fn(*args, **kwargs)
            finally:
                self._depth.n -= 1
            if kwargs.get("async_op"):
                return _Waited(self, work, request)
            self.add("wait", request=request)  # a blocking call: the stream waits for it
            if name in _SYNCING:
                self.add("sync", name=name)
            return work
        return logged

    def wrap_batch(self, fn):
        @functools.wraps(fn)
        def logged(ops):
            if self.inside() or not ops:
                return fn(ops)
            messages = tuple(LoggedMessage("send" if op.op.__name__ == "isend" else "recv", op.peer,
                                     op.tensor.numel() * op.tensor.element_size())
                             for op in ops)
            request = self.add("post", group=_ranks(ops[0].group), messages=messages)
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:  # its messages are this one post: not each logged on its own
                works = fn(ops)
            finally:
                self._depth.n -= 1
            return [_Waited(self, w, request) for w in works]
        return logged

    def wrap_unbatched(self, name: str, fn):
        @functools.wraps(fn)
        def logged(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            group = args[2] if len(args) > 2 else kwargs.get("group")
            if self.inside() or peer is None:  # recv from any rank: gloo only, not replayed
                return fn(*args, **kwargs)
            message = LoggedMessage(_UNBATCHED[name], peer, tensor.numel() * tensor.element_size())
            request = self.add("post", group=_ranks(group), messages=(message,), batched=False)
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                work = fn(*args, **kwargs)
            finally:
                self._depth.n -= 1
            if name in ("send", "recv"):  # blocking
                self.add("wait", request=request)
                return work
            return _Waited(self, work, request)
        return logged


_active: list[MessageLog] = []  # the log being recorded in this process, if any


def note(kind: str, key: str) -> None:
    """Log a host-side signal outside the network: "publish" (this rank makes `key`
    known, as the pipeline publishes a message's shape in the rendezvous store) or
    "await" (this rank's host waits until some rank has published `key`)."""
    for log in _active:
        log.add(kind, name=key)


def _on_device(args) -> bool:
    """Whether the call reads a tensor off the rank's device: with an accelerator (or the
    faked one) only its tensors sync; on a CPU every tensor counts (the safe side)."""
    if not on_accelerator():
        return True
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"


def _to_host(args, kwargs) -> bool:
    target = (kwargs or {}).get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


@contextmanager
def recording() -> Iterator[MessageLog]:
    """Log this rank's messages, collectives, waits and host syncs inside the block."""
    log = MessageLog()
    saved = {}
    for name in (*TORCH_COLLECTIVES, *_UNBATCHED):
        saved[name] = getattr(dist, name)
        wrap = log.wrap_unbatched if name in _UNBATCHED else log.wrap_collective
        setattr(dist, name, wrap(name, saved[name]))
    for name in _UNBATCHED:  # P2POp checks its op against c10d's own names
        setattr(c10d, name, getattr(dist, name))
    saved["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = log.wrap_batch(saved["batch_isend_irecv"])
    _active.append(log)
    try:
        with log:
            yield log
    finally:
        _active.remove(log)
        for name, fn in saved.items():
            setattr(dist, name, fn)
            if name in _UNBATCHED:
                setattr(c10d, name, fn)
