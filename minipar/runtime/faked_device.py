"""A faked accelerator: rank code runs on a device that is not the host, on a CPU.

On a GPU every rank computes on its own card, and an op that mixes a host tensor with a
device tensor fails there (an embedding handed host ids, a host tensor indexed by
device positions, an add of the two). CI has no GPU. This module gives torch a device
named "fakegpu" whose tensors hold real data in host memory, so every kernel runs and
every number is the CPU's, while each op checks its arguments as CUDA would and fails
where CUDA would, naming the minipar line that asked for it (`DeviceMixError`).

How: torch's PrivateUse1 backend, registered from Python (torch.utils.
backend_registration, the path `test_privateuseone_python_backend.py` tests). Its
allocation kernels (`empty`, `empty_strided`) return a `DeviceTensor`: a tensor
subclass over host storage whose `.device` says "fakegpu:i". Its `__torch_dispatch__`
sees every op below autograd, checks the mix, runs the CPU kernel and marks the
outputs as device tensors again. Copies to and from the host (`.to()`, `.cpu()`,
`copy_`) pass and count as what they are; `.item()`, `.tolist()` and copies to the host
are the host syncs a GPU would have; `.numpy()` fails, as on CUDA.

Where it stops: CUDA lets a host tensor with no dimensions (a scalar) join a device op,
and so does this check; it does not model streams' timing, the allocator, or kernels
that exist on CPU but not on CUDA (and the reverse). `torch.compile` on it is untested.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# the accelerator module's calls (torch.fakegpu is this module): faked_accelerator.py
from .faked_accelerator import (  # noqa: F401
    NAME,
    Event,
    FakedEvent,
    FakedStream,
    Stream,
    _in_flight,
    _index,
    _is_in_bad_fork,
    _landed,
    _lock,
    current_device,
    current_stream,
    device_count,
    get_amp_supported_dtype,
    get_device_name,
    get_rng_state,
    is_available,
    is_initialized,
    manual_seed_all,
    max_memory_allocated,
    memory_allocated,
    opened,
    record_stream,
    reset_peak_memory_stats,
    set_device,
    set_rng_state,
    stream,
    synchronize,
    used_on,
)

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_installed = False
# frames that are not where an op was asked for: this file, and the NCCL rehearsal's log
_SKIPPED = {__file__, os.path.join(PACKAGE, "collectives", "message_log.py")}
syncs = 0  # host syncs on device tensors so far in this process (tests read it)

# ops that take a host tensor beside a device one on CUDA too: copies, and indexing a
# device tensor with host indices
_MAY_MIX = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::index",
            "aten::index_put_", "aten::_index_put_impl_", "aten::index_put", "aten::set_",
            "aten::_local_scalar_dense", "aten::lift_fresh", "aten::_pin_memory",
            "aten::is_pinned"}
_INDEXING = {"aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put"}


class DeviceMixError(RuntimeError):
    """An op on the faked device got a host tensor where a GPU would refuse one."""


def _unwrapped():
    # run the op on the underlying host storage: without the Python key, a DeviceTensor
    # dispatches as the plain CPU tensor it is
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Python))


class DeviceTensor(torch.Tensor):
    """A tensor on the faked device: host storage, a device that says "fakegpu:i"."""

    _index: int

    @staticmethod
    def wrap(t: torch.Tensor, index: int) -> DeviceTensor:
        out = torch.Tensor._make_subclass(DeviceTensor, t, t.requires_grad)
        out._index = index
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device(NAME, self._index)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return False

    def cpu(self, memory_format=torch.preserve_format) -> torch.Tensor:  # type: ignore[override]
        return self.to("cpu")

    def numpy(self, *args, **kwargs):  # type: ignore[override]
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                        "Tensor.cpu() to copy the tensor to host memory first.")

    def tolist(self):  # type: ignore[override]
        return self.cpu().tolist()

    def to(self, *args, **kwargs):  # type: ignore[override]
        target = _target_device(args, kwargs)
        if target is not None and target.type == "cpu":
            _host_sync()
            dtype = next((a for a in args if isinstance(a, torch.dtype)), kwargs.get("dtype"))
            with _unwrapped(), torch.no_grad() if not self.requires_grad else _nothing():
                out = torch.Tensor.to(self.as_subclass(torch.Tensor), "cpu", copy=True)
            return out if dtype is None else out.to(dtype)
        if target is not None and target.type == NAME and \
                (target.index is None or target.index == self._index):
            rest = [a for a in args if not isinstance(a, (str, torch.device))]
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            return super().to(*rest, **kwargs) if rest or kwargs else self
        return super().to(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        # pickled (a rank's answer, a checkpoint) as the host tensor it holds
        return self.cpu().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = _check(func, args, kwargs)
        with _unwrapped():
            out = func(*args, **kwargs)
        name = func._schema.name
        if name == "aten::copy_" and type(args[0]) is not DeviceTensor and \
                (kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
            # a copy to the host that returns at once: its buffer is not to be read until
            # a synchronize (on a GPU the copy engine may still be writing it)
            with _lock:
                _in_flight.add(args[0].untyped_storage().data_ptr())
        if name == "aten::_local_scalar_dense":
            _host_sync()
            return out
        if args and out is args[0]:  # in place (copy_ into a host buffer too): as it was
            return out
        # a `_to_copy` that names the host here comes from torch's own kernels, which read a
        # DeviceTensor's options as the host's (ToCopyBackward casting a gradient back): it
        # stays on the device. Copies to the host go through DeviceTensor.to/.cpu above.
        return tree_map(lambda t: DeviceTensor.wrap(t, index)
                        if type(t) is torch.Tensor else t, out)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _target_device(args, kwargs) -> torch.device | None:
    for a in (*args, kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _host_sync() -> None:
    global syncs
    syncs += 1


def _where() -> tuple[str, bool]:
    """The innermost line outside torch and this file, and whether it is minipar's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name not in _SKIPPED and "contextlib" not in name:
            inside = name.startswith(PACKAGE)
            return f"{name[len(PACKAGE):] if inside else name}:{frame.f_lineno}", inside
        frame = frame.f_back
    return "?", False


def _check(func, args, kwargs) -> int:
    """The device index of the op's device tensors; raises where CUDA would refuse."""
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on = [t for t in tensors if type(t) is DeviceTensor]
    indices = {t._index for t in on}
    name = func._schema.name
    if len(indices) > 1:
        _refuse(f"{name} got tensors on {NAME}:{min(indices)} and {NAME}:{max(indices)}")
    host = [t for t in tensors if type(t) is not DeviceTensor and t.dim() > 0
            and getattr(t, "_made_on_host", False)]
    if on and host and name not in _MAY_MIX:
        _refuse(f"{name} got a host tensor {tuple(host[0].shape)} beside device tensors")
    if name in _INDEXING and on and type(args[0]) is not DeviceTensor:
        _refuse(f"{name}: a host tensor indexed by device indices")
    return next(iter(indices)) if indices else current_device()


class HostTags(TorchFunctionMode):
    """Tags each host tensor that Python code makes (a factory without a device, a
    `torch.from_numpy`, a copy to the host, or any op on host tensors alone), so that the
    mix check knows it from the host tensors torch's own C++ kernels allocate inside a
    device op (one_hot's classes, say: they follow the storage, which is the host's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs))
        # a copy into the buffer, or an attribute set to it (`.grad = buffer`), reads nothing
        if _in_flight and func is not torch.Tensor.copy_ and func.__name__ != "__set__":
            for t in flat:
                if type(t) is torch.Tensor and t.untyped_storage().data_ptr() in _in_flight:
                    _refuse("a host buffer is read while a non-blocking copy from the device "
                            "may still be writing it (wait for it: runtime.copies_landed())")
        out = func(*args, **(kwargs or {}))
        if not any(type(t) is DeviceTensor for t in flat) or func in _TO_HOST:
            for t in tree_flatten(out)[0]:
                if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
                    try:
                        t._made_on_host = True
                    except (AttributeError, RuntimeError):
                        pass
        return out


_TO_HOST = {torch.Tensor.cpu, torch.Tensor.to}


def _refuse(what: str) -> None:
    where, inside = _where()
    if inside:  # a learner's or a test's own mix is theirs to make
        raise DeviceMixError(f"{where}: {what} (on a GPU this fails: move it with "
                             ".to(device()))")


def install() -> None:
    """Register the faked device with torch once per process (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=sys.modules[__name__])
    lib = torch.library.Library("aten", "IMPL")  # kept: the kernels live while it does
    _KEEP.append(lib)

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
        t = torch.empty(size, dtype=dtype, device="cpu", memory_format=memory_format or
                        torch.contiguous_format)
        return DeviceTensor.wrap(t, _index(device))

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return DeviceTensor.wrap(torch.empty_strided(size, stride, dtype=dtype, device="cpu"),
                                 _index(device))

    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    _installed = True


_KEEP: list = []
