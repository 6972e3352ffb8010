"""Exercise checks of lesson 02 (a gradient-averaging hook, bucketed all-reduce) and of
lesson 10 (top-k compression with error feedback)."""

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
    return torch.randn(12, 5, generator=torch.Generator().manual_seed(12), dtype=torch.float64)


def _run_hook(hook: Callable) -> list[list[float]]:
    model = _hook_model()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    local = shard(_hook_batch())
    (model(local) ** 2).mean().backward()
    return [p.grad.reshape(-1).tolist() for p in model.parameters()]


def check_gradient_hook(average_gradient_hook: Callable, world_size: int = 4) -> str:
    """Register `average_gradient_hook(param)` on every parameter of a model on real ranks
    (12 samples, 3 per rank) and compare every gradient with one process's."""
    refuse_library("average_gradient_hook", average_gradient_hook)
    got = run_on_ranks("average_gradient_hook", _run_hook, world_size, average_gradient_hook)
    model = _hook_model()
    (model(_hook_batch()) ** 2).mean().backward()
    names = [name for name, _ in model.named_parameters()]
    for index, p in enumerate(model.parameters()):
        want = p.grad.reshape(-1)
        for rank, grads in enumerate(got):
            mine = torch.tensor(grads[index], dtype=torch.float64)
            if torch.allclose(mine, want, rtol=1e-10, atol=1e-12):
                continue
            hint = ""
            if torch.allclose(mine, want * world_size, rtol=1e-10, atol=1e-12):
                hint = (f" It is {world_size}x too large: you summed the ranks' gradients; "
                        "divide by the world size to average them.")
            elif rank == 0 and not torch.allclose(
                    torch.tensor(got[1][index], dtype=torch.float64), mine):
                hint = " Ranks disagree: the gradient was not all-reduced."
            raise ExerciseError(f"average_gradient_hook: rank {rank}, parameter '{names[index]}' "
                                f"has gradient {mine[:3].tolist()}..., expected "
                                f"{want[:3].tolist()}... (one process, whole batch).{hint}")
    return (f"average_gradient_hook: every gradient on all {world_size} ranks equals "
            "one process's")


def _run_bucketed(fn: Callable, sizes: list[int], bucket_bytes: int) -> tuple:

    grads = [torch.full((n,), float(runtime.rank() + 1) * (i + 1), dtype=torch.float32)
             for i, n in enumerate(sizes)]
    calls = []
    original = collectives.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    collectives.all_reduce = counted
    try:
        fn(grads, bucket_bytes)
    finally:
        collectives.all_reduce = original
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
