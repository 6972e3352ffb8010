"""Lesson 04's exercise checks: the g operator and a row-parallel linear layer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks


def _call_g(g_class: type) -> tuple[list[float], list[float], bool]:
    # a different partial sum on every rank, so a g that skips the all-reduce shows
    partial = (torch.arange(4, dtype=torch.float64) + 1) * (runtime.rank() + 1)
    x = partial.clone().requires_grad_(True)
    y = g_class.apply(x)
    unchanged = torch.equal(x.detach(), partial)  # the caller's tensor must keep its values
    # a different upstream gradient on every rank: an all-reduce in backward would show
    upstream = torch.arange(4, dtype=torch.float64) + 10 * (runtime.rank() + 1)
    y.backward(upstream)
    return y.detach().tolist(), x.grad.tolist(), unchanged


def check_g_operator(g_class: type, world_size: int = 2) -> str:
    """`g_class.apply(x)` must all-reduce (sum) x forward and pass the gradient through
    unchanged backward, on every rank."""
    refuse_library("g_operator", g_class)
    got = run_on_ranks("g_operator", _call_g, world_size, g_class)
    total = sum((torch.arange(4, dtype=torch.float64) + 1) * (r + 1) for r in range(world_size))
    for r, (out, grad, unchanged) in enumerate(got):
        upstream = torch.arange(4, dtype=torch.float64) + 10 * (r + 1)
        if not unchanged:
            raise ExerciseError(f"g_operator forward on rank {r} changed its input in place: the "
                                "caller's partial sum now holds the total, and autograd may reuse "
                                "it. All-reduce a copy (y = x.clone(), then all-reduce y).")
        if not torch.allclose(torch.tensor(out, dtype=torch.float64), total):
            raise ExerciseError(f"g_operator forward on rank {r} gave {out}, expected "
                                f"{total.tolist()}: g sums the ranks' partial results "
                                "(all-reduce) in the forward pass")
        if not torch.allclose(torch.tensor(grad, dtype=torch.float64), upstream):
            hint = " (that is an all-reduce: g's backward is the identity; f's is the " \
                   "all-reduce)" if torch.allclose(
                torch.tensor(grad, dtype=torch.float64),
                sum(torch.arange(4, dtype=torch.float64) + 10 * (q + 1)
                    for q in range(world_size))) else ""
            raise ExerciseError(f"g_operator backward on rank {r} gave {grad}, expected the "
                                f"incoming gradient {upstream.tolist()} unchanged{hint}")
    return f"g_operator: all-reduce forward, identity backward on {world_size} ranks"


def _call_row(fn: Callable) -> tuple:
    torch.manual_seed(31)
    twin = torch.nn.Linear(8, 3, dtype=torch.float64)
    k, me = runtime.world_size(), runtime.rank()
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(32))
    x_local = x.chunk(k, dim=-1)[me].clone().requires_grad_(True)
    weight = twin.weight.detach().chunk(k, dim=1)[me].clone().requires_grad_(True)
    bias = twin.bias.detach().clone().requires_grad_(True)
    y = fn(x_local, weight, bias)
    # sin, not a plain sum: the upstream gradient then depends on y, so wrong outputs show in it
    y.sin().sum().backward()
    return (y.detach(), x_local.grad, weight.grad, bias.grad)


def check_row_parallel_linear(row_parallel_linear: Callable,
                              world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`row_parallel_linear(x_local, weight_local, bias)`: x's columns and the weight's
    columns are this rank's slices; the result must be the full layer's output on every
    rank, and every gradient must match the single-process layer's (sliced)."""
    refuse_library("row_parallel_linear", row_parallel_linear)
    torch.manual_seed(31)
    twin = torch.nn.Linear(8, 3, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(32))
    x.requires_grad_(True)
    y = twin(x)
    y.sin().sum().backward()
    for k in world_sizes:
        got = run_on_ranks("row_parallel_linear", _call_row, k, row_parallel_linear)
        for r, (out, gx, gw, gb) in enumerate(got):
            where = f"row_parallel_linear on {k} ranks, rank {r}"
            if not torch.allclose(out, y.detach()):
                partial = out.shape == y.shape and not torch.allclose(out, y.detach())
                raise ExerciseError(f"{where}: output differs from the full layer's." + (
                    " Each rank's product is only a partial sum: all-reduce it (g) and add "
                    "the bias once, after the reduction." if partial else ""))
            checks = (("x_local", gx, x.grad.chunk(k, dim=-1)[r]),
                      ("weight_local", gw, twin.weight.grad.chunk(k, dim=1)[r]),
                      ("bias", gb, twin.bias.grad))
            for name, mine, want in checks:
                if mine is None:
                    raise ExerciseError(
                        f"{where}: no gradient reached {name}. A collective called outside "
                        "autograd (dist.all_reduce into a detached buffer, for instance) returns "
                        "a tensor with no history, so backward stops there: wrap it in an "
                        "autograd Function (g: all-reduce forward, identity backward).")
                if not torch.allclose(mine, want):
                    raise ExerciseError(f"{where}: the gradient of {name} is wrong. Use an "
                                        "operator whose backward passes the gradient through "
                                        "unchanged (g), so autograd does the rest.")
    return (f"row_parallel_linear: output and every gradient match on "
            f"{', '.join(map(str, world_sizes))} ranks")
