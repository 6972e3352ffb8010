"""The placement trap: on a CPU machine, catch every tensor minipar would put on the wrong
device of a GPU machine.

On a GPU box every rank computes on its own device (`device()`), and a tensor the
library makes anywhere else meets the first collective or matmul as an error, or as a
silent copy through the host. CI has no GPU, so the trap stands in for one. It watches
torch's factory functions (`torch.zeros`, `torch.arange`, `torch.tensor`, and the
`torch.empty` an `nn.Linear` calls while it is built) and fails loudly, naming the file
and line, when minipar's code makes a tensor:
- without saying where (no `device=`): on a GPU it would land on the CPU;
- on a device written out as a string or a number, such as `device="cpu"`: a hard-coded
  device is the rank's on no machine but one.

A `torch.device` passes: `device()` or another tensor's `.device`, the two ways the
library names the rank's device (the meta device, storage-free, passes too). Code that
means to use the host, a seeded draw copied over or a checkpoint written from host
memory, says so with `host_allocations()`: the short, stated allow-list. Only minipar's
own files are watched; a learner's function, torch's internals and tests make tensors as
they like.

Ranks run under the trap when the launcher's environment has `MINIPAR_PLACEMENT_TRAP=1`
(the test suite sets it) or inside `placement_trap()`; `MINIPAR_PLACEMENT_TRAP=list` lists
every offending place once per rank on stderr and carries on."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

TRAP_ENV = "MINIPAR_PLACEMENT_TRAP"
# the functions that make a new tensor from nothing: its device comes from the call
FACTORIES = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.arange, torch.linspace, torch.eye, torch.tensor, torch.empty_strided,
})
# as the interpreter names code objects' files (not resolved: frames carry import paths)
PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
TORCH_MODULES = os.path.join(TORCH, "nn", "modules") + os.sep  # nn.Linear and the like
_host = threading.local()  # depth of host_allocations() blocks, per thread


class PlacementError(RuntimeError):
    """A tensor minipar made off the rank's device."""


@contextmanager
def host_allocations() -> Iterator[None]:
    """Mark a block that makes host tensors on purpose (a seeded CPU draw copied to the
    device, a checkpoint staged in host memory): the trap lets its factory calls pass."""
    _host.depth = getattr(_host, "depth", 0) + 1
    try:
        yield
    finally:
        _host.depth -= 1


def _minipar(frame) -> tuple[str, int] | None:
    name = frame.f_code.co_filename
    return (name[len(PACKAGE) - len("minipar/"):], frame.f_lineno) \
        if name.startswith(PACKAGE) and name != __file__ else None


def _caller() -> tuple[tuple[str, int], tuple[str, int] | None] | None:
    """Where minipar asked for the tensor, or None when torch's own code did (an
    optimizer's step counters, say: torch places those). While a module is being built,
    torch's (`nn.Linear(...)`) or minipar's, the answer is the code that built the
    outermost one, which says where the module lives (built on meta, or on the host and
    moved), with the line inside the constructor beside it."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or "contextlib" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if name.startswith(TORCH) and not name.startswith(TORCH_MODULES):
        return None
    # the code that called the factory: minipar's, or a module's constructor in torch;
    # anyone else's (a test, a notebook cell, a learner's exercise) is theirs to place
    in_torch_module = name.startswith(TORCH_MODULES)
    inner, builder, f = _minipar(frame), None, frame
    while f is not None:
        if in_torch_module:
            inner = inner or _minipar(f)
        if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), torch.nn.Module):
            builder = f.f_back
        f = f.f_back
    if builder is None:
        return (inner, None) if inner is not None else None
    built_by = _minipar(builder)
    return (built_by, inner) if built_by is not None else None


class _Trap(TorchFunctionMode):
    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict, self.seen = strict, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and not getattr(_host, "depth", 0):
            where = kwargs.get("device")
            # meta: built without storage, to be materialized on the device later
            wrong = where is None or (not isinstance(where, torch.device) and where != "meta")
            found = _caller() if wrong else None
            if found is not None:
                (path, line), inside = found
                what = ("without device=" if where is None else
                        f"on device={where!r}, written out")
                built = "" if inside is None else \
                    f" (building a module: the tensor at {inside[0]}:{inside[1]})"
                message = (f"{path}:{line}: torch.{func.__name__} made a tensor {what}{built};"
                           f" pass device=device() (minipar.runtime), or device=<a tensor's>"
                           f".device, or wrap a deliberate host copy in host_allocations()")
                caller = (path, line)
                if self.strict:
                    raise PlacementError(message)
                if caller not in self.seen:  # list mode: each place once, and carry on
                    self.seen.add(caller)
                    print(f"placement: {message}", file=sys.stderr)
        return func(*args, **kwargs)


@contextmanager
def placement_trap(strict: bool = True) -> Iterator[None]:
    """Run the block with the trap on in this process: factory calls from minipar's code
    must name the rank's device (`device()`, or a tensor's `.device`). `strict=False`
    lists each offending place once on stderr instead of raising (a survey)."""
    with _Trap(strict):
        yield


def trap_requested() -> str | None:
    """How ranks run under the trap: MINIPAR_PLACEMENT_TRAP=1 raises, =list lists."""
    value = os.environ.get(TRAP_ENV)
    return value if value in ("1", "list") else None
