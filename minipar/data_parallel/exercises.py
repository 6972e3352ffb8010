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


_FEEDBACK_STEPS, _FEEDBACK_SIZE, _FEEDBACK_K = 6, 20, 3


def _feedback_gradient(rank: int, step: int) -> torch.Tensor:
    return torch.randn(_FEEDBACK_SIZE, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1000 * rank + step))


def _topk_reference(grad: torch.Tensor, residual: torch.Tensor, k: int,
                    by: Callable = torch.abs) -> tuple:
    """(sent, new residual) when keeping the k entries of grad + residual largest by `by`."""
    corrected = grad + residual
    keep = by(corrected).topk(k).indices
    sent = torch.zeros_like(corrected).index_put_((keep,), corrected[keep])
    return sent, corrected - sent


def _run_feedback(fn: Callable) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each step: compress this rank's gradient, average what was sent over the ranks (the
    update every rank applies). Returns each step's (sent, residual) and the applied sum."""
    residual = torch.zeros(_FEEDBACK_SIZE, dtype=torch.float64)
    applied = torch.zeros(_FEEDBACK_SIZE, dtype=torch.float64)
    steps = []
    for step in range(_FEEDBACK_STEPS):
        grad = _feedback_gradient(runtime.rank(), step)
        sent, residual = fn(grad.clone(), residual.clone(), _FEEDBACK_K)
        sent, residual = torch.as_tensor(sent), torch.as_tensor(residual)
        if sent.shape != grad.shape or residual.shape != grad.shape:
            raise ValueError(f"step {step}: return two tensors shaped like the gradient "
                             f"{tuple(grad.shape)}; got {tuple(sent.shape)} and "
                             f"{tuple(residual.shape)}")
        applied += collectives.all_reduce(sent.to(torch.float64).clone(), op="avg")
        steps.append((sent.to(torch.float64), residual.to(torch.float64)))
    return steps, applied


def check_error_feedback(topk_with_error_feedback: Callable, world_size: int = 2) -> str:
    """Run `topk_with_error_feedback(grad, residual, k) -> (sent, residual)` for a few steps
    on real ranks. Each step must send the k largest-magnitude entries of grad + residual
    (zeros elsewhere) and keep the rest as the next residual, so that over the run the
    applied averages plus the mean residual add up to the mean gradients: nothing is lost."""
    refuse_library("topk_with_error_feedback", topk_with_error_feedback)
    got = run_on_ranks("topk_with_error_feedback", _run_feedback, world_size,
                       topk_with_error_feedback)
    for r, (steps, _) in enumerate(got):
        residual = torch.zeros(_FEEDBACK_SIZE, dtype=torch.float64)
        for step, (sent, their_residual) in enumerate(steps):
            grad = _feedback_gradient(r, step)
            want_sent, want_residual = _topk_reference(grad, residual, _FEEDBACK_K)
            where = f"topk_with_error_feedback: rank {r}, step {step}"
            if int((sent != 0).sum()) > _FEEDBACK_K:
                raise ExerciseError(f"{where}: sent {int((sent != 0).sum())} nonzero entries; "
                                    f"keep only the k = {_FEEDBACK_K} largest, zeros elsewhere")
            if not torch.allclose(sent, want_sent):
                alone, _ = _topk_reference(grad, torch.zeros_like(grad), _FEEDBACK_K)
                by_value, _ = _topk_reference(grad, residual, _FEEDBACK_K, by=lambda t: t)
                why = ("you compressed this step's gradient alone: add the residual first "
                       "(corrected = grad + residual), or what was dropped is lost for good"
                       if step > 0 and torch.allclose(sent, alone) else
                       "that keeps the largest values; keep the largest magnitudes "
                       "(corrected.abs().topk(k)), negative entries matter as much"
                       if torch.allclose(sent, by_value) else
                       "send the k largest-magnitude entries of grad + residual, zeros elsewhere")
                raise ExerciseError(f"{where}: sent the wrong entries: {why}")
            if not torch.allclose(their_residual, want_residual):
                why = (" It is what the corrected gradient lost (grad + residual - sent), "
                       "not grad - sent." if torch.allclose(their_residual, grad - sent) else
                       " It is grad + residual - sent.")
                raise ExerciseError(f"{where}: the residual is wrong.{why}")
            residual = want_residual
    gradients = sum(_feedback_gradient(r, s) for r in range(world_size)
                    for s in range(_FEEDBACK_STEPS)) / world_size
    mean_residual = sum(steps[-1][1] for steps, _ in got) / world_size
    for r, (_, applied) in enumerate(got):
        if not torch.allclose(applied + mean_residual, gradients):
            raise ExerciseError(f"topk_with_error_feedback: on rank {r} the applied updates plus "
                                "the mean residual differ from the mean gradients")
    return (f"topk_with_error_feedback: right on {world_size} ranks for {_FEEDBACK_STEPS} steps; "
            "applied + mean residual = mean gradients, nothing lost")
