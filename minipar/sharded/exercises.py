"""Lesson 06's exercise checks: a ZeRO-1 optimizer step and an FSDP unit's forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import collectives, runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks

_NUMEL, _STEPS, _LR, _BETA = 12, 3, 0.1, 0.9


def _gradient(rank: int, step: int) -> torch.Tensor:
    # a CPU generator draws on the host: moved just below
    grad = torch.randn(_NUMEL, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(100 * step + rank))
    return grad.to(runtime.device())


def _start() -> torch.Tensor:
    return torch.linspace(-1, 1, _NUMEL, dtype=torch.float64, device=runtime.device())


def _run_zero1(fn: Callable) -> tuple[list[torch.Tensor], int, dict[str, int]]:
    k, me = runtime.world_size(), runtime.rank()
    flat = _start()
    momentum = torch.zeros(_NUMEL // k, dtype=torch.float64, device=runtime.device())
    history = []
    with collectives.meter() as m:
        for step in range(_STEPS):
            fn(flat, _gradient(me, step), momentum, _LR, _BETA)
            history.append(flat.clone())
    return history, momentum.numel(), dict(m.calls)


def check_zero1_step(zero1_step: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`zero1_step(flat, grad, momentum, lr, beta)` on every rank: `flat` the full parameters,
    `grad` this rank's gradient, `momentum` this rank's slice of the momentum buffer. After
    each call every rank's `flat` must equal one process's momentum SGD on the averaged
    gradient, with one reduce-scatter and one all-gather per step."""
    refuse_library("zero1_step", zero1_step)
    for k in world_sizes:
        got = run_on_ranks("zero1_step", _run_zero1, k, zero1_step)
        flat, velocity = _start(), torch.zeros(_NUMEL, dtype=torch.float64)
        for step in range(_STEPS):
            mean = sum(_gradient(r, step) for r in range(k)) / k
            velocity = _BETA * velocity + mean
            flat = flat - _LR * velocity
            for r, (history, _, calls) in enumerate(got):
                mine = history[step]
                if torch.allclose(mine, flat):
                    continue
                where = f"zero1_step on {k} ranks, rank {r}, step {step}"
                if "all_gather" not in calls:
                    raise ExerciseError(f"{where}: only this rank's slice is up to date. After "
                                        "updating it, all-gather the slices into flat.")
                wrong = (mine - flat).abs() > 1e-9
                slices = sorted({int(i) // (_NUMEL // k) for i in wrong.nonzero().flatten()})
                raise ExerciseError(
                    f"{where}: slices {slices} of the parameters differ from one process's "
                    f"(each slice is {_NUMEL // k} numbers, slice s belongs to rank s). Use "
                    "collectives.reduce_scatter(grad, op='avg') for this rank's averaged "
                    "slice, update momentum and that slice, then all-gather.")
        for r, (_, momentum_numel, calls) in enumerate(got):
            if momentum_numel != _NUMEL // k:
                raise ExerciseError(f"zero1_step on {k} ranks, rank {r}: the momentum slice "
                                    f"now holds {momentum_numel} numbers; update it in place")
            if calls.get("all_reduce"):
                raise ExerciseError(
                    f"zero1_step on {k} ranks, rank {r}: right numbers, but with an all-reduce: "
                    "every rank receives the whole averaged gradient and uses 1/K of it. "
                    "reduce_scatter delivers only this rank's slice, and with the all-gather "
                    "moves what one all-reduce moves.")
    return (f"zero1_step: one process's momentum SGD on {', '.join(map(str, world_sizes))} "
            "ranks, momentum sharded, reduce-scatter + all-gather")


def _unit_twin() -> nn.Linear:
    torch.manual_seed(61)
    # seeded on the host, then moved: the same unit anywhere
    unit = nn.Linear(5, 3, dtype=torch.float64)  # 18 numbers: padded for 4 ranks
    return unit.to(runtime.device())


def _held_numbers(tensors: list[torch.Tensor], skip: torch.Tensor | None = None) -> int:
    """How many numbers the distinct storages behind `tensors` still hold (not `skip`'s)."""
    held = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and (skip is None
                                 or storage.data_ptr() != skip.untyped_storage().data_ptr()):
            held[storage.data_ptr()] = storage.nbytes() // t.element_size()
    return sum(held.values())


def _saved_for_backward(y: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor autograd's graph behind `y` saved for backward."""
    saved, seen, stack = [], set(), [getattr(y, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                saved += [value] if isinstance(value, torch.Tensor) else []
        stack += [n for n, _ in node.next_functions]
    return saved


def _run_fsdp_forward(fn: Callable) -> tuple[torch.Tensor, int, int, dict[str, int]]:
    k, me = runtime.world_size(), runtime.rank()
    twin = _unit_twin()
    flat = torch.cat([twin.weight.detach().reshape(-1), twin.bias.detach()])
    size = -(-flat.numel() // k)
    flat = torch.cat([flat, flat.new_zeros(size * k - flat.numel())])
    unit = _unit_twin()
    for p in unit.parameters():
        p.data = torch.empty(0, dtype=torch.float64, device=p.device)
    # a layer's input needs its gradient, so autograd saves the weight for backward
    x = _unit_input().requires_grad_(True)
    with collectives.meter() as m:
        y = fn(unit, flat[me * size:(me + 1) * size].clone(), x)
    return (torch.as_tensor(y).detach(), _held_numbers(list(unit.parameters())),
            _held_numbers(_saved_for_backward(torch.as_tensor(y)), skip=x), dict(m.calls))


def _unit_input() -> torch.Tensor:
    # a CPU generator draws on the host: moved just below
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(62))
    return x.to(runtime.device())


def check_fsdp_forward(fsdp_forward: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`fsdp_forward(unit, shard, x)`: `unit` is an nn.Linear(5, 3) whose parameters are
    empty, `shard` this rank's slice of its flat parameters (weight then bias, zero-padded
    to a multiple of K), `x` an input that needs its gradient. Gather, compute, free: the
    output must be the full layer's, and afterwards no storage of the gathered parameters
    may hold a byte, neither the parameters' nor the view autograd saved for backward."""
    refuse_library("fsdp_forward", fsdp_forward)
    want = _unit_twin()(_unit_input()).detach()
    for k in world_sizes:
        got = run_on_ranks("fsdp_forward", _run_fsdp_forward, k, fsdp_forward, crash_hints={
            "must be a matrix": "called the unit while its parameters were still empty: "
                                "all-gather the shard and set each p.data first"})
        for r, (y, kept, saved, calls) in enumerate(got):
            where = f"fsdp_forward on {k} ranks, rank {r}"
            if "all_gather" not in calls:
                raise ExerciseError(f"{where}: no all-gather: each rank holds only its slice; "
                                    "collectives.all_gather(shard) gives the whole flat vector")
            if y.shape != want.shape or not torch.allclose(y, want):
                raise ExerciseError(
                    f"{where}: the output differs from the full layer's. The gathered vector "
                    "is the weight (15 numbers, view it as (3, 5)) then the bias (3); the rest "
                    "is padding. Set p.data for each parameter before calling the unit.")
            if kept:
                raise ExerciseError(f"{where}: the parameters still hold {kept} numbers after "
                                    "the forward. Free them: keeping every unit whole is what "
                                    "ZeRO-3 exists to avoid.")
            if saved:
                raise ExerciseError(
                    f"{where}: the parameters look empty, but autograd saved a view of the "
                    f"gathered weight for backward, and its storage still holds {saved} "
                    "numbers: p.data = torch.empty(0) only repoints the parameter. Shrink the "
                    "storage itself, p.untyped_storage().resize_(0), as fsdp.py does.")
    return (f"fsdp_forward: gather, compute, free on {', '.join(map(str, world_sizes))} ranks; "
            "output equals the full layer")
