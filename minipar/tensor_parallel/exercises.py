"""Lesson 04's exercise checks: the g operator, and the Megatron MLP with f and g placed
by the learner."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks


def _call_g(g_class: type) -> tuple[list[float], list[float], bool]:
    # a different partial sum on every rank, so a g that skips the all-reduce shows
    partial = (torch.arange(4, dtype=torch.float64, device=runtime.device()) + 1) \
        * (runtime.rank() + 1)
    x = partial.clone().requires_grad_(True)
    y = g_class.apply(x)
    unchanged = torch.equal(x.detach(), partial)  # the caller's tensor must keep its values
    # a different upstream gradient on every rank: an all-reduce in backward would show
    upstream = torch.arange(4, dtype=torch.float64, device=runtime.device()) \
        + 10 * (runtime.rank() + 1)
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


H, FFN, TOKENS = 8, 16, 5  # the MLP the check splits: hidden 8, inner width 16, 5 tokens


def _mlp_twin() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, h], W_up [ffn, h], W_down [h, ffn]: nn.Linear's layout, float64."""
    g = torch.Generator().manual_seed(41)
    # a CPU generator draws on the host: moved just below
    drawn = (torch.randn(TOKENS, H, dtype=torch.float64, generator=g),
             torch.randn(FFN, H, dtype=torch.float64, generator=g) / H**0.5,
             torch.randn(H, FFN, dtype=torch.float64, generator=g) / FFN**0.5)
    return tuple(t.to(runtime.device()) for t in drawn)


def _mlp_one_process() -> tuple:
    x, up, down = (t.clone().requires_grad_(True) for t in _mlp_twin())
    y = torch.nn.functional.gelu(x @ up.t()) @ down.t()
    # sin, not a plain sum: the upstream gradient then depends on y, so wrong outputs show in it
    y.sin().sum().backward()
    return y.detach(), x.grad, up.grad, down.grad


def _call_mlp(fn: Callable) -> dict:
    k, me = runtime.world_size(), runtime.rank()
    x, up, down = _mlp_twin()
    up, down = up.chunk(k, dim=0)[me], down.chunk(k, dim=1)[me]  # column-, row-parallel
    # this rank's share of the output before any reduction: what a missing g returns
    partial = torch.nn.functional.gelu(x @ up.t()) @ down.t()
    x, up_shard, down_shard = (t.clone().requires_grad_(True) for t in (x, up, down))
    y = fn(x, up_shard, down_shard)
    if not isinstance(y, torch.Tensor):
        return {"type": type(y).__name__}
    if y.requires_grad:
        y.sin().sum().backward()
    return {"y": y.detach(), "partial": partial, "x": x.grad, "up": up_shard.grad,
            "down": down_shard.grad}


def _mlp_hint(r: int, k: int, got: dict, want: tuple) -> str | None:
    """The mistake rank r's answer looks like, or None if it is right."""
    y, gx, gup, gdown = want
    if "type" in got:
        return f"rank {r} returned a {got['type']}; return the output tensor [tokens, hidden]"
    if not torch.allclose(got["y"], y):
        if torch.allclose(got["y"], got["partial"]):
            return (f"rank {r} returned only its own partial sum: after the row-parallel "
                    "down projection each rank holds a part of the output; sum them with g")
        return (f"rank {r}'s output differs from one process's: gelu acts on this rank's own "
                "slice of the inner activation, and g (all-reduce) comes after the down "
                "projection; an all-reduce before gelu sums the inputs of a nonlinearity")
    if got["x"] is None or got["up"] is None or got["down"] is None:
        return (f"rank {r}: no gradient reached x or a weight. A collective called outside "
                "autograd (dist.all_reduce on a detached tensor) cuts the graph: use f and g, "
                "autograd functions whose backward is the other collective")
    if not (torch.allclose(got["up"], gup.chunk(k, dim=0)[r])
            and torch.allclose(got["down"], gdown.chunk(k, dim=1)[r])):
        return (f"rank {r}: the output is right but a weight's gradient is not: g's backward "
                "passes the gradient through unchanged (an all-reduce there makes it tp "
                "times too large)")
    if not torch.allclose(got["x"], gx):
        return (f"rank {r}: x's gradient is only this rank's part: apply f to x before the "
                "up projection (identity forward, all-reduce backward), so every rank gets "
                "the sum over the ranks' slices")
    return None


def check_megatron_mlp(megatron_mlp: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`megatron_mlp(x, up_shard, down_shard)`: x [tokens, hidden] on every rank, this
    rank's rows of W_up and columns of W_down (nn.Linear's [out, in] layout). Every rank
    must return the whole MLP's output gelu(x W_up^T) W_down^T, and autograd must give x
    and both shards one process's gradients (sliced): f before the up projection, g after
    the down projection, and nothing between them."""
    refuse_library("megatron_mlp", megatron_mlp)
    want = _mlp_one_process()
    for k in world_sizes:
        got = run_on_ranks("megatron_mlp", _call_mlp, k, megatron_mlp)
        for r, answer in enumerate(got):
            hint = _mlp_hint(r, k, answer, want)
            if hint:
                raise ExerciseError(f"megatron_mlp on {k} ranks: {hint}.")
    return (f"megatron_mlp: output and every gradient equal one process's on "
            f"{', '.join(map(str, world_sizes))} ranks")
