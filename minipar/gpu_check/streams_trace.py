"""The GPU check's streams case: a profiler trace of one step, on NCCL ranks, showing
NCCL's kernels running under compute kernels for DDP's bucket all-reduces, FSDP's
prefetched all-gathers and the tensor-parallel overlap.

The faked device checks the order the streams keep (runtime/streams.py); only a GPU shows
whether work on two streams really runs at once. The measure is the time some NCCL
kernel and some other kernel were both running, from the kernels' device timestamps,
as a share of the NCCL kernels' time. It is a weak test: NCCL's kernels always run on
NCCL's own stream, and a kernel spinning while it waits for its peer counts as running,
so some overlap shows even where the communication thread queued behind compute; the
share, read beside the same step with `overlap=False`, is what says more.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from ..runtime import device, rank, synchronize

KINDS = ("DDP", "FSDP prefetch", "tp overlap")


def _ddp_step():
    from ..data_parallel import DataParallel
    from ..models import mlp, mse

    model = DataParallel(mlp([4096] * 9, seed=1), bucket_bytes=16 << 20)
    x, y = torch.randn(256, 4096, device=device()), torch.randn(256, 4096, device=device())
    step = lambda: mse(model(x), y).backward()  # noqa: E731
    step()  # a step to warm up; the one after is traced
    return step


def _fsdp_step():
    from ..models import mlp, mse
    from ..sharded.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(mlp([4096] * 9, seed=1),
                                     lambda p: torch.optim.SGD(p, lr=1e-3), prefetch=True)
    x, y = torch.randn(256, 4096, device=device()), torch.randn(256, 4096, device=device())

    def step():
        mse(model(x), y).backward()
        model.step()

    step()
    return step


def _tp_overlap_step():
    from ..tensor_parallel.collective_matmul import all_gather_matmul

    x = torch.randn(4096, 4096, device=device())
    w = torch.randn(8192, 4096, device=device())  # [out, in], as nn.Linear keeps it
    step = lambda: all_gather_matmul(x, w)  # noqa: E731
    step()
    return step


def overlap_on_rank(kind: str, trace_path: str | None = None) -> dict:
    """One traced step of `kind` on this rank: how many NCCL and other kernels ran, and
    for how many seconds both kinds ran at once."""
    step = {"DDP": _ddp_step, "FSDP prefetch": _fsdp_step, "tp overlap": _tp_overlap_step}[
        kind]()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        synchronize()
    if trace_path is not None and rank() == 0:
        prof.export_chrome_trace(trace_path)
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower())
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    comm = [(a, b) for a, b, is_nccl in kernels if is_nccl]
    compute = [(a, b) for a, b, is_nccl in kernels if not is_nccl]
    both = sum(max(0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    nccl = sum(b - a for a, b in comm)
    return {"nccl kernels": len(comm), "other kernels": len(compute), "overlap_s": both / 1e6,
            "nccl_s": nccl / 1e6}
