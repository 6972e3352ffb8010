"""The device helper: which backend, which device, which rank. The one place that
touches torch.cuda; everything else asks these functions."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .placement import host_allocations

BACKENDS = ("auto", "gloo", "nccl")

_device = torch.device("cpu")
_copy_stream = None  # this rank's second CUDA stream for host<->device copies, made on first use


def cpu_cores() -> int:
    """CPU cores this process may run on (ranks beyond them take turns)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_count() -> int:
    """Number of visible CUDA GPUs (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, ranks_per_machine: int) -> str:
    """Turn "auto" into "nccl" (one GPU per rank available) or "gloo"; check the others."""
    if backend not in BACKENDS:
        allowed = ", ".join(map(repr, BACKENDS))
        raise ValueError(f"backend must be one of {allowed}; got {backend!r}")
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= ranks_per_machine and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and (gpus < ranks_per_machine or not dist.is_nccl_available()):
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_per_machine} ranks but {gpus} GPUs "
            "visible (or NCCL is missing from this torch build); use backend='gloo' to run on "
            "CPU processes, or backend='auto' to pick for you")
    return backend


def _bind_device(backend: str, local_rank: int) -> None:
    global _device
    if backend == "nccl":
        # NCCL wants each rank bound to its own GPU before its first collective
        torch.cuda.set_device(local_rank)
        _device = torch.device("cuda", local_rank)
    else:
        _device = torch.device("cpu")
_copy_stream = None  # this rank's second CUDA stream for host<->device copies, made on first use


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    return _device


def synchronize() -> None:
    """Wait for queued GPU work on this rank's device (a no-op on CPU); use before timing."""
    if _device.type == "cuda":
        torch.cuda.synchronize(_device)


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like `t` in host memory: page-locked (pinned) when the
    rank computes on a GPU, so copies to and from it can run while the GPU computes."""
    with host_allocations():  # host memory on purpose: the other end of an offload copy
        return torch.empty(t.shape, dtype=t.dtype, device="cpu",
                           pin_memory=_device.type == "cuda")


def compute_ready() -> object | None:
    """A mark after the work queued so far on this rank's compute stream (a CUDA event) for
    a copy to wait for; None on CPU, where that work is done when the call returns."""
    if _device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@contextmanager
def on_copy_stream(ready: object | None = None) -> Iterator[None]:
    """Run the block's copies on a second stream of this rank's GPU, after the compute
    stream's work up to `ready` (from `compute_ready`), then wait for them (the calling
    thread waits, not the compute stream). On CPU there is no stream to pick: the block
    just runs, and the thread that runs it (a copy thread) stands for the stream."""
    global _copy_stream
    if _device.type != "cuda":
        yield
        return
    if _copy_stream is None:
        _copy_stream = torch.cuda.Stream(_device)
    with torch.cuda.stream(_copy_stream):
        if ready is not None:
            # the copy reads what compute wrote, or writes memory compute freed: wait for it
            _copy_stream.wait_event(ready)
        yield
    _copy_stream.synchronize()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the run, or inside `group` (0 outside any launch)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in the run, or in `group` (1 outside any launch)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1
