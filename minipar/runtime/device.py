"""The device helper: which backend, which device, which rank. The one place that
touches torch.cuda; everything else asks these functions."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .cpu_kind import cpu_kind, cpu_model
from .placement import host_allocations

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")  # auto: a GPU per rank under NCCL, else the CPU

_device = torch.device("cpu")
_copy_stream = None  # this rank's second CUDA stream for host<->device copies, made on first use


def cpu_cores() -> int:
    """CPU cores this process may run on (ranks beyond them take turns)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_count() -> int:
    """Number of visible CUDA GPUs (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_line() -> str:
    """Which machine produced a benchmark's figures: the CPU's model and kind, its cores,
    the GPUs torch sees and torch's version (every benchmark's first line)."""
    gpus = gpu_count()
    names = f", {gpus} x {torch.cuda.get_device_name(0)}" if gpus else ", no GPU"
    return f"machine: {cpu_model()} ({cpu_kind()}), {cpu_cores()} cores{names}; " \
           f"torch {torch.__version__}"


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


def resolve_device(device_: str, backend: str) -> str:
    """Turn "auto" into "cuda" under NCCL or "cpu" under gloo; check the others.

    "cuda" under gloo puts the ranks on the GPUs there are, several ranks on one card
    when there are more ranks than cards (rank r on GPU r mod count): a course's one GPU
    runs a whole mesh, and minipar's messages reach gloo through host memory
    (collectives/host_staging.py)."""
    if device_ not in DEVICES:
        allowed = ", ".join(map(repr, DEVICES))
        raise ValueError(f"device must be one of {allowed}; got {device_!r}")
    if device_ == "auto":
        return "cuda" if backend == "nccl" else "cpu"
    if device_ == "cpu" and backend == "nccl":
        raise ValueError("device='cpu' with backend='nccl': NCCL moves GPU memory only; use "
                         "backend='gloo' for CPU ranks")
    if device_ == "cuda" and gpu_count() == 0:
        raise ValueError("device='cuda' but torch sees no GPU here (a CPU-only build, or no "
                         "driver): use device='cpu'; `minipar doctor` says what this machine has")
    return device_


def _bind_device(backend: str, local_rank: int, device_: str = "auto") -> None:
    global _device
    if resolve_device(device_, backend) == "cuda":
        # NCCL wants each rank bound to its own GPU before its first collective; under gloo
        # ranks may share a card, so they wrap around the ones there are
        index = local_rank if backend == "nccl" else local_rank % gpu_count()
        torch.cuda.set_device(index)
        _device = torch.device("cuda", index)
    else:
        _device = torch.device("cpu")


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, a GPU it may share with
    other ranks under gloo with device="cuda", else the CPU."""
    return _device


@contextmanager
def building_on(where: torch.device) -> Iterator[None]:
    """`device()` answers `where` inside the block: a dry run builds every module on the
    meta device (shapes and dtypes, no storage, nothing computed; train/dry_run.py)."""
    global _device
    previous, _device = _device, torch.device(where)
    try:
        yield
    finally:
        _device = previous


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


def device_name() -> str:
    """What this rank computes on, as its maker names it: the GPU's name ("NVIDIA H100
    80GB HBM3"), or the CPU's model on a CPU ("CPU (AMD EPYC 9R14)")."""
    if _device.type == "cuda":
        return torch.cuda.get_device_name(_device)
    return f"CPU ({cpu_model()})"


def reset_memory_peak() -> None:
    """Start counting `memory_peak` afresh from here (a no-op on CPU)."""
    if _device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(_device)


def memory_peak() -> int | None:
    """The most bytes torch's allocator held on this rank's GPU since the last
    `reset_memory_peak` (torch.cuda.max_memory_allocated); None on CPU, where torch keeps
    no such count."""
    return torch.cuda.max_memory_allocated(_device) if _device.type == "cuda" else None


@contextmanager
def allocator_history(path: str | os.PathLike) -> Iterator[None]:
    """Record every allocation and free on this rank's GPU inside the block, with its
    Python stack, and write them to `path` (a pickle that https://pytorch.org/memory_viz
    draws). CUDA's allocator only: on CPU it refuses."""
    if _device.type != "cuda":
        raise ValueError("the allocator snapshot records CUDA's caching allocator, and this "
                         "rank computes on the CPU; leave the snapshot off here")
    # private but documented API (torch.cuda.memory, "Understanding CUDA Memory Usage")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(os.fspath(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the run, or inside `group` (0 outside any launch)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in the run, or in `group` (1 outside any launch)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1
