"""The device helper: which backend, which device, which rank. The one place that
touches torch.cuda; everything else asks these functions."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist

from . import faked_device
from .cpu_kind import cpu_kind, cpu_model

BACKENDS = ("auto", "gloo", "nccl")
# auto: a GPU per rank under NCCL, else the CPU; fakegpu: runtime/faked_device.py
DEVICES = ("auto", "cpu", "cuda", "fakegpu")
FAKED_ENV = "MINIPAR_FAKED_DEVICE"  # =1: each task's ranks compute on the faked device

_device = torch.device("cpu")


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
    """Turn "auto" into "nccl" (one GPU per rank available) or "gloo" (no GPU: CPU
    processes); check the others. "auto" never falls back quietly: with GPUs, but fewer
    than ranks, it stops with one line that says what to pass instead."""
    if backend not in BACKENDS:
        allowed = ", ".join(map(repr, BACKENDS))
        raise ValueError(f"backend must be one of {allowed}; got {backend!r}")
    gpus = gpu_count()
    if backend == "auto":
        if gpus == 0 or not dist.is_nccl_available():
            return "gloo"
        if gpus < ranks_per_machine:
            raise ValueError(_too_few_gpus(gpus, ranks_per_machine))
        return "nccl"
    if backend == "nccl" and (gpus < ranks_per_machine or not dist.is_nccl_available()):
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_per_machine} ranks but {gpus} GPUs "
            "visible (or NCCL is missing from this torch build); use backend='gloo' to run on "
            "CPU processes, or backend='auto' to pick for you")
    return backend


def _too_few_gpus(gpus: int, ranks: int) -> str:
    if gpus == 1 and os.environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        return (f"each of torchrun's {ranks} processes on this node sees one GPU (its own "
                "CUDA_VISIBLE_DEVICES?), while minipar gives LOCAL_RANK its GPU of those it "
                "sees: let every process see all the node's GPUs, or pass --backend gloo")
    return (f"backend='auto' with {ranks} ranks per machine and {gpus} GPU(s): NCCL needs "
            "one GPU per rank. Pass backend='gloo', device='cuda' to share the GPUs (ranks "
            "take turns on each), backend='gloo', device='cpu' for CPU processes, or at "
            f"most {gpus} ranks")


def _nvidia_smi(field: str) -> list[str]:
    """One `nvidia-smi --query-gpu` field, a line per GPU; [] where it is absent or fails."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def exclusive_process_gpus() -> list[int]:
    """The GPUs in EXCLUSIVE_PROCESS compute mode (one process each: ranks cannot share
    them), as nvidia-smi reports; [] where it is absent or says nothing."""
    return [i for i, mode in enumerate(_nvidia_smi("compute_mode"))
            if "exclusive_process" in mode.lower()]


def gpu_facts() -> dict:
    """The GPUs torch sees, as a report records them: names, the driver, CUDA's version."""
    gpus = gpu_count()
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "driver": (_nvidia_smi("driver_version") or [None])[0],
            "cuda": torch.version.cuda, "torch": torch.__version__}


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
    if device_ == "fakegpu" and backend != "gloo":
        raise ValueError("device='fakegpu' is a rehearsal on CPU processes: use it with "
                         "backend='gloo'")
    if device_ == "cuda" and gpu_count() == 0:
        raise ValueError("device='cuda' but torch sees no GPU here (a CPU-only build, or no "
                         "driver): use device='cpu'; `minipar doctor` says what this machine has")
    return device_


def check_sharing(device_: str, backend: str, ranks_per_machine: int) -> None:
    """Ranks that share a GPU (gloo, device='cuda', more ranks than GPUs) cannot on a GPU
    in EXCLUSIVE_PROCESS compute mode: say so in one line, before any rank starts."""
    gpus = gpu_count()
    if device_ != "cuda" or backend != "gloo" or ranks_per_machine <= gpus:
        return
    exclusive = exclusive_process_gpus()
    if exclusive:
        raise ValueError(f"GPU(s) {exclusive} are in EXCLUSIVE_PROCESS compute mode: one "
                         f"process each, so {ranks_per_machine} ranks cannot share {gpus} "
                         "GPU(s); run at most one rank per GPU, or ask for DEFAULT mode "
                         "(nvidia-smi -c DEFAULT)")


def _bind_device(backend: str, local_rank: int, device_: str = "auto") -> None:
    global _device
    if resolve_device(device_, backend) == "fakegpu":
        _device = _faked(local_rank)
        faked_device.HostTags().__enter__()  # for the process's life, on its main thread
    elif resolve_device(device_, backend) == "cuda":
        # NCCL wants each rank bound to its own GPU before its first collective; under gloo
        # ranks may share a card, so they wrap around the ones there are
        index = local_rank if backend == "nccl" else local_rank % gpu_count()
        torch.cuda.set_device(index)
        _device = torch.device("cuda", index)
    else:
        _device = torch.device("cpu")


def _faked(local_rank: int) -> torch.device:
    faked_device.install()
    if dist.is_initialized() and dist.get_backend() == "gloo":
        # the default group's gloo serves the faked device as it serves the host (its
        # tensors' storage is the host's): a learner's own dist.batch_isend_irecv runs
        world = dist.distributed_c10d._get_default_group()
        world._register_backend(torch.device(faked_device.NAME),
                                dist.ProcessGroup.BackendType.GLOO,
                                world._get_backend(torch.device("cpu")))
    # Module.to() swaps each parameter's contents in place, so a Parameter stays the
    # object optimizers and hooks hold, now a faked-device tensor
    torch.__future__.set_swap_module_params_on_conversion(True)
    faked_device.set_device(local_rank)
    return torch.device(faked_device.NAME, local_rank)


@contextmanager
def faked_for_task(on: bool, local_rank: int) -> Iterator[None]:
    """Inside the block, a rank that computes on the CPU computes on the faked device
    instead (the launcher's FAKED_ENV, read per task: ranks outlive one test)."""
    global _device
    if not on or _device.type != "cpu":
        yield
        return
    swap = torch.__future__.get_swap_module_params_on_conversion()
    previous, _device = _device, _faked(local_rank)
    try:
        with faked_device.HostTags():
            yield
    finally:
        _device = previous
        torch.__future__.set_swap_module_params_on_conversion(swap)


def thread_checks() -> AbstractContextManager:
    """What a thread of this rank enters first: on the faked device its per-thread checks
    (faked_device.HostTags), elsewhere nothing."""
    return faked_device.HostTags() if _device.type == faked_device.NAME else nullcontext()


def faked_requested() -> bool:
    """Whether the launcher's environment asks for the faked device (FAKED_ENV=1)."""
    return os.environ.get(FAKED_ENV) == "1"


def on_accelerator() -> bool:
    """Whether this rank computes on a device that is not the host (a GPU, or the faked
    one): where copies to the host are syncs and host tensors cannot join device ops."""
    return _device.type in ("cuda", faked_device.NAME)


def _accelerator():
    """torch.cuda, or the faked device's module: the same calls on either."""
    return faked_device if _device.type == faked_device.NAME else torch.cuda


def autocast_device_type() -> str:
    """What torch.autocast calls this rank's device ("cuda" or "cpu"; the faked device's
    kernels are the host's)."""
    return "cuda" if _device.type == "cuda" else "cpu"


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
    if on_accelerator():
        _accelerator().synchronize(_device)


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like `t` in host memory: page-locked (pinned) when the
    rank computes on a GPU, so copies to and from it can run while the GPU computes."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=_device.type == "cuda")


def device_name() -> str:
    """What this rank computes on, as its maker names it: the GPU's name ("NVIDIA H100
    80GB HBM3"), or the CPU's model on a CPU ("CPU (AMD EPYC 9R14)")."""
    if on_accelerator():
        return _accelerator().get_device_name(_device)
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


def nccl_device_id(backend: str) -> torch.device | None:
    """What `init_process_group(device_id=)` gets: the rank's GPU under NCCL, else None.
    With it, NCCL makes the group's communicator at once ("eager") and every message,
    batched or not, goes on it; without it, a message posted on its own would go on a
    communicator made for that pair at first use (collectives/nccl_replay.py). minipar
    posts every message in a batch either way; binding the device also makes the first
    collective on each group cheap and silences torch's barrier warning."""
    return _device if backend == "nccl" else None


def on_the_host(value):
    """`value` with every tensor on a device copied to host memory: a rank's answer is
    unpickled by the launcher (or, under torchrun, by every rank), which must not open a
    context on the sender's GPU. Lists, tuples, dicts and dataclasses are walked."""
    return _moved(value, lambda t: t if t.device.type in ("cpu", "meta") else t.cpu())


def on_this_device(value):
    """`value` with every host tensor moved to this rank's `device()`: the launcher's
    arguments were made on the host (its process computes nowhere else), and a rank
    computes on its device; walked as `on_the_host` walks an answer."""
    return _moved(value, lambda t: t.to(_device) if t.device.type == "cpu" else t)


def _moved(value, move: Callable[[torch.Tensor], torch.Tensor]):
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_moved(v, move) for v in value)
    if type(value) is dict:
        return {k: _moved(v, move) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), move)
                                                 for f in dataclasses.fields(value) if f.init})
        except (TypeError, ValueError):  # a dataclass that cannot be rebuilt: as it is
            return value
    return value


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the run, or inside `group` (0 outside any launch)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in the run, or in `group` (1 outside any launch)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1
