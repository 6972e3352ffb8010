"""Lesson 03's exercise checks: a 1F1B generator and a stage's forward step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..models import linear_stack
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


def _stage_batch() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(22), dtype=torch.float64)


def _call_stage(fn: Callable) -> list[float]:
    me = runtime.rank()
    module = _stage_layers(runtime.world_size())[me]
    x = _stage_batch() if me == 0 else None
    with torch.no_grad():
        out = fn(module, x)
    return out.reshape(-1).tolist()


def check_stage_forward(stage_forward: Callable, world_size: int = 3) -> str:
    """Run `stage_forward(module, x)` on real ranks: rank 0 gets the batch, the others None
    and must receive their input (shape (3, 4), float64) from the rank before; each returns
    its stage's output after sending it on. Every rank's output is checked."""
    refuse_library("stage_forward", stage_forward)
    got = run_on_ranks("stage_forward", _call_stage, world_size, stage_forward, timeout=15)
    x = _stage_batch()
    with torch.no_grad():
        for r, layer in enumerate(_stage_layers(world_size)):
            x = layer(x)
            mine = torch.tensor(got[r], dtype=torch.float64)
            if mine.shape != x.reshape(-1).shape or not torch.allclose(mine, x.reshape(-1)):
                raise ExerciseError(
                    f"stage_forward: rank {r} returned {got[r][:3]}..., expected "
                    f"{x.reshape(-1)[:3].tolist()}... (stage {r}'s output). "
                    + ("Rank 0 computes on the batch it is given." if r == 0 else
                       f"Rank {r} must receive rank {r - 1}'s output, then apply its module."))
    return f"stage_forward: every stage's output right on {world_size} ranks"
