"""Lesson 03's exercise checks: a 1F1B generator and a stage's forward step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..models import linear_stack, mse
from .plan import Schedule, add_communication, peak_in_flight
from .simulate import simulate, validate


def check_one_f_one_b(one_f_one_b: Callable,
                      cases: tuple[tuple[int, int], ...] = ((2, 4), (4, 8), (4, 4), (3, 7), (4, 2))
                      ) -> str:
    """`one_f_one_b(p, m)` returns each rank's compute order (lists of Action F/B). Wrapped
    with sends and receives, it must validate, have GPipe's bubble (p-1)/(m+p-1) with B=2F,
    and hold at most p - rank micro-batches on rank r (fewer if m < p)."""
    refuse_library("one_f_one_b", one_f_one_b)

    for p, m in cases:
        where = f"one_f_one_b(p={p}, m={m})"
        try:
            orders = one_f_one_b(p, m)
        except NotImplementedError:
            raise ExerciseError(f"{where}: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        if not isinstance(orders, list) or len(orders) != p:
            raise ExerciseError(f"{where}: return a list with one list of actions per rank "
                                f"({p} lists)")
        plan = Schedule("1f1b (yours)", p, m, 1)
        try:
            plan.actions = add_communication(plan, orders)
            validate(plan)
        except ValueError as err:
            raise ExerciseError(f"{where}: {err}") from None
        bubble = simulate(plan, {"F": 1.0, "B": 2.0}).summary(p).bubble_fraction
        if abs(bubble - (p - 1) / (m + p - 1)) > 1e-9:
            raise ExerciseError(f"{where}: bubble {bubble:.4f}, but 1F1B's is (p-1)/(m+p-1) = "
                                f"{(p - 1) / (m + p - 1):.4f}; the warm-up on rank r is "
                                "p-1-r forwards, then one forward and one backward in turn")
        for r, peak in enumerate(peak_in_flight(plan)):
            if peak > min(p - r, m):
                raise ExerciseError(
                    f"{where}: rank {r} holds {peak} micro-batches' activations at once; 1F1B "
                    f"holds at most p - rank = {min(p - r, m)} (GPipe would hold all {m}). "
                    f"Rank {r}'s order: {' '.join(map(str, orders[r]))}")
    return f"one_f_one_b: valid, GPipe's bubble with 1F1B's memory on {len(cases)} shapes"


def _stage_layers(k: int) -> list[torch.nn.Module]:
    return list(linear_stack(4, k, seed=21, dtype=torch.float64))


def _stage_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(22)
    # a CPU generator draws on the host: moved just below
    x, target = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return x.to(runtime.device()), target.to(runtime.device())


def _mse_to(target: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda out: mse(out, target)


def _call_stage_step(fn: Callable) -> tuple[list[float], list[list[float] | None]]:
    me, k = runtime.rank(), runtime.world_size()
    module = _stage_layers(k)[me]
    x, target = _stage_batch()
    out = fn(module, x if me == 0 else None, _mse_to(target) if me == k - 1 else None)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"stage_step returned {type(out).__name__}; return the stage's output")
    grads = [None if p.grad is None else p.grad.reshape(-1).tolist()
             for p in module.parameters()]
    return out.detach().reshape(-1).tolist(), grads


_NO_INPUT_GRAD = ("the input a rank receives is a plain tensor with no history, so after "
                  "backward its .grad is None unless you call x.requires_grad_() before the "
                  "forward")
_STAGE_CRASHES = {
    "NoneType": "used None where a tensor was expected. If it was x.grad: " + _NO_INPUT_GRAD + ".",
    "implicitly created only for scalar outputs": (
        "called backward() on its output, which is not a scalar; only the last rank has a "
        "loss. Other ranks receive the output's gradient from rank + 1 and call "
        "out.backward(grad)."),
}
_DEADLOCK = ("Each rank's step is: receive the input (rank > 0), forward, then the last rank "
             "calls loss.backward() while every other rank receives the output's gradient "
             "from rank + 1 and calls out.backward(grad); finally every rank > 0 sends x.grad "
             "to rank - 1. A rank that never sends the gradient leaves rank - 1 waiting.")


def check_stage_step(stage_step: Callable, world_size: int = 3) -> str:
    """Run `stage_step(module, x, loss_fn)` on real ranks: one micro-batch forward through
    every stage and its gradient back. Rank 0 gets the batch, the last rank the loss
    function, the others None. Every rank's output and its module's gradients must equal
    one process running the whole model."""
    refuse_library("stage_step", stage_step)
    got = run_on_ranks("stage_step", _call_stage_step, world_size, stage_step, timeout=15,
                       crash_hints=_STAGE_CRASHES, deadlock_hint=_DEADLOCK)
    model = torch.nn.Sequential(*_stage_layers(world_size))
    x, target = _stage_batch()
    outs = []
    for layer in model:
        x = layer(x)
        outs.append(x)
    _mse_to(target)(x).backward()
    for r in range(world_size):
        mine = torch.tensor(got[r][0], dtype=torch.float64)
        if mine.shape != outs[r].reshape(-1).shape or not torch.allclose(
                mine, outs[r].detach().reshape(-1)):
            raise ExerciseError(
                f"stage_step: rank {r} returned {got[r][0][:3]}..., expected "
                f"{outs[r].reshape(-1)[:3].tolist()}... (stage {r}'s output). "
                + ("Rank 0 computes on the batch it is given." if r == 0 else
                   f"Rank {r} must receive rank {r - 1}'s output, then apply its module."))
    for r, layer in enumerate(model):
        for p, grad in zip(layer.parameters(), got[r][1], strict=True):
            if grad is None:
                raise ExerciseError(
                    f"stage_step: rank {r}'s module has no gradient. "
                    + ("The last rank calls loss_fn(out).backward()." if r == world_size - 1
                       else f"Rank {r} receives d loss / d output from rank {r + 1} and "
                            "calls out.backward(grad)."))
            if not torch.allclose(torch.tensor(grad, dtype=torch.float64), p.grad.reshape(-1)):
                raise ExerciseError(
                    f"stage_step: rank {r}'s gradients differ from one process's. "
                    + ("The last rank calls loss_fn(out).backward() on its own output."
                       if r == world_size - 1 else
                       f"Rank {r} backpropagates the gradient rank {r + 1} sent, which must be "
                       f"the gradient of rank {r + 1}'s input (x.grad), not of its output."))
    return (f"stage_step: every stage's output and gradients equal one process on "
            f"{world_size} ranks")
