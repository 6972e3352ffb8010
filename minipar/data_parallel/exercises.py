"""Exercise checks of lesson 02 (an overlapped gradient-averaging hook, bucketed all-reduce)
and of lesson 10 (top-k compression with error feedback)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import collectives, runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..models import mlp
from .ddp import shard


def _hook_model() -> torch.nn.Module:
    return mlp([5, 7, 3], seed=11, dtype=torch.float64)


def _hook_batch() -> torch.Tensor:
    # a CPU generator draws on the host: moved just below
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    return x.to(runtime.device())


class _WatchedWork:
    """An async all-reduce's handle that logs when it is waited on, and in which phase."""

    def __init__(self, work, log: list, index: int, phase: list) -> None:
        self.work, self.log, self.index, self.phase = work, log, index, phase

    def wait(self, *args, **kwargs):
        self.log.append(("wait", self.index, self.phase[0]))
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _run_overlap(averager_class: type) -> dict:
    """One backward with the learner's hook on every parameter, then `finish()`; every
    dist.all_reduce started is logged (in which phase, async or not) and so is every wait."""
    import torch.distributed as dist

    model = _hook_model()
    averager = averager_class()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(averager.hook)
    log: list = []
    phase = ["backward"]
    original = dist.all_reduce

    def watched(tensor, *args, async_op=False, **kwargs):
        index = sum(entry[0] == "start" for entry in log)
        log.append(("start", index, phase[0], bool(async_op)))
        work = original(tensor, *args, async_op=async_op, **kwargs)
        return _WatchedWork(work, log, index, phase) if async_op else work

    dist.all_reduce = watched
    try:
        (model(shard(_hook_batch())) ** 2).mean().backward()
        phase[0] = "finish"
        averager.finish()
    finally:
        dist.all_reduce = original
    return {"grads": [p.grad.reshape(-1).tolist() for p in model.parameters()], "log": log}


def _overlap_hint(got: dict, parameters: int) -> str | None:
    """What the log says about overlap, or None when every all-reduce ran under backward."""
    starts = [e for e in got["log"] if e[0] == "start"]
    waits = [e for e in got["log"] if e[0] == "wait"]
    if len(starts) < parameters:
        return (f"{len(starts)} dist.all_reduce calls were started for {parameters} parameters: "
                "start one in hook() for each parameter, dist.all_reduce(param.grad, "
                "async_op=True)")
    blocking = [e for e in starts if not e[3]]
    if blocking:
        return ("an all-reduce was blocking (async_op=False), so backward stopped until it "
                "was done: start it with async_op=True and keep the handle it returns")
    if any(e[2] != "backward" for e in starts):
        return "an all-reduce started in finish(): start each one in hook(), during backward"
    early = [e for e in waits if e[2] == "backward"]
    if early:
        return ("a handle was waited on inside hook(): that stops backward just as a blocking "
                "all-reduce does; keep the handles and wait in finish()")
    waited = {e[1] for e in waits}
    missing = [e[1] for e in starts if e[1] not in waited]
    if missing:
        return (f"finish() did not wait on {len(missing)} of the {len(starts)} handles: a "
                "gradient may be read before its all-reduce is done")
    return None


def check_overlapped_hook(averager_class: type, world_size: int = 4) -> str:
    """`averager_class()` with `hook(param)`, registered as every parameter's post-accumulate
    hook, and `finish()`, called once after backward. Every rank's gradients must equal
    one process's on the whole batch, every all-reduce must start asynchronously inside
    backward and be waited on only in finish(): the overlap DDP gets from its buckets."""
    refuse_library("OverlappedAverager", averager_class)
    got = run_on_ranks("OverlappedAverager", _run_overlap, world_size, averager_class)
    model = _hook_model()
    (model(_hook_batch()) ** 2).mean().backward()
    names = [name for name, _ in model.named_parameters()]
    for rank, answer in enumerate(got):
        hint = _overlap_hint(answer, len(names))
        if hint:
            raise ExerciseError(f"OverlappedAverager: rank {rank}: {hint}.")
        for index, p in enumerate(model.parameters()):
            want = p.grad.reshape(-1)
            mine = torch.tensor(answer["grads"][index], dtype=torch.float64)
            if torch.allclose(mine, want, rtol=1e-10, atol=1e-12):
                continue
            why = (f" It is {world_size}x too large: the all-reduce sums; divide by the world "
                   "size, after the wait" if torch.allclose(mine, want * world_size, rtol=1e-10)
                   else " Divide only after the handle's wait: an all-reduce in flight still "
                   "writes into param.grad")
            raise ExerciseError(f"OverlappedAverager: rank {rank}, parameter '{names[index]}' "
                                f"has gradient {mine[:3].tolist()}..., expected "
                                f"{want[:3].tolist()}... (one process, whole batch).{why}.")
    return (f"OverlappedAverager: every gradient on all {world_size} ranks equals one "
            "process's, each all-reduce started inside backward and waited on after it")


def _run_bucketed(fn: Callable, sizes: list[int], bucket_bytes: int) -> tuple:

    grads = [torch.full((n,), float(runtime.rank() + 1) * (i + 1), dtype=torch.float32,
                        device=runtime.device()) for i, n in enumerate(sizes)]
    calls: list[int] = []
    inside = [0]  # minipar's all-reduce may call torch's: count the outer call once
    original, original_torch = collectives.all_reduce, torch.distributed.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        inside[0] += 1
        try:
            return original(tensor, *args, **kwargs)
        finally:
            inside[0] -= 1

    def counted_torch(tensor, *args, **kwargs):  # dist.all_reduce is a bucket's call too
        if not inside[0]:
            calls.append(tensor.numel())
        return original_torch(tensor, *args, **kwargs)

    collectives.all_reduce, torch.distributed.all_reduce = counted, counted_torch
    try:
        fn(grads, bucket_bytes)
    finally:
        collectives.all_reduce, torch.distributed.all_reduce = original, original_torch
    return [g.tolist() for g in grads], calls


def _reference_buckets(sizes: list[int], bucket_bytes: int) -> list[int]:
    """Elements per bucket: tensors in order, a new bucket when the next would overflow."""
    buckets: list[int] = []
    used = 0
    for n in sizes:
        if not buckets or used + 4 * n > bucket_bytes:
            buckets.append(0)
            used = 0
        buckets[-1] += n
        used += 4 * n
    return buckets


def check_bucketing(bucketed_all_reduce: Callable, world_size: int = 2) -> str:
    """Run `bucketed_all_reduce(grads, bucket_bytes)` on real ranks for several layouts;
    check every averaged value and that each bucket took exactly one all-reduce."""
    refuse_library("bucketed_all_reduce", bucketed_all_reduce)
    cases = [([4, 4, 4, 4], 32), ([10, 1, 1, 10], 48), ([3, 50, 2], 40), ([5, 5], 1 << 20)]
    for sizes, bucket_bytes in cases:
        results = run_on_ranks("bucketed_all_reduce", _run_bucketed, world_size,
                                bucketed_all_reduce, sizes, bucket_bytes)
        mean_rank = sum(r + 1 for r in range(world_size)) / world_size
        for rank, (grads, _) in enumerate(results):
            for i, values in enumerate(grads):
                want = mean_rank * (i + 1)
                if any(abs(v - want) > 1e-6 for v in values):
                    raise ExerciseError(
                        f"bucketed_all_reduce(sizes={sizes}, bucket_bytes={bucket_bytes}): rank "
                        f"{rank}, tensor {i} holds {values[:3]}..., expected {want:g} everywhere "
                        "(the average over ranks). Did you copy the bucket back into each "
                        "tensor after the all-reduce?")
        expected = _reference_buckets(sizes, bucket_bytes)
        calls = results[0][1]
        if calls != expected:
            why = ""
            if len(calls) == len(sizes) and len(expected) != len(sizes):
                why = " One all-reduce per tensor is not bucketing: pack tensors together."
            elif len(calls) == 1 and len(expected) > 1:
                why = " Everything went in one all-reduce: respect bucket_bytes."
            raise ExerciseError(
                f"bucketed_all_reduce(sizes={sizes}, bucket_bytes={bucket_bytes}) made "
                f"all-reduces of {calls} elements; expected {expected} (fill buckets in order "
                f"with float32 = 4 bytes, start a new one when the next tensor would not fit)."
                + why)
    return (f"bucketed_all_reduce: right values and one all-reduce per bucket in {len(cases)} "
            "layouts")
