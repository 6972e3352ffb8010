"""Megatron's mappings as autograd functions on minipar's collectives: what each does
forward, and its mirror backward.

f = `copy_to_parallel_region`: identity forward, all-reduce backward.
g = `reduce_from_parallel_region`: all-reduce forward, identity backward.
scatter / gather split and join the last dimension; the sequence-parallel pair
all-gathers and reduce-scatters along the sequence, `SEQUENCE_DIM` of the decoder's
[batch, seq, hidden] (any other `dim` when a caller's tokens lie elsewhere).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from ..runtime import rank, world_size

# The sequence is dim 1 of [batch, seq, hidden], the decoder's layout. The sequence-parallel
# pair takes it as a dimension rather than transposing to [seq, batch, hidden] at a block's
# edges: attention and RoPE read [batch, seq, ...], so a transpose would have to be undone
# inside every half of the block, while the pair only moves the dim around its collective.
SEQUENCE_DIM = 1


def _tp(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) inside the tensor-parallel group."""
    return rank(group), world_size(group)


def _slice_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    me, size = _tp(group)
    # a column slice of a row-major tensor is strided: copy it into memory of its own
    return x.chunk(size, dim=dim)[me].contiguous()


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # identity without a copy: a view, a new tensor object for f's backward to attach to
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # the all-reduce writes in place: reduce a copy, since autograd may hand the same grad
        # tensor to other consumers; None is the gradient for `group`
        return collectives.all_reduce(grad.contiguous().clone(), group=ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # a copy: x (a partial sum) must not be overwritten in place under autograd
        return collectives.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        # y = x_0 + ... + x_(K-1), so dL/dx_r = dL/dy: the gradient passes through as it is
        return grad, None


class _ScatterToParallel(torch.autograd.Function):
    """Keep this rank's slice of dimension `dim`; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _slice_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, ctx.dim, ctx.group), None, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather dimension `dim`; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice_along(grad, ctx.dim, ctx.group), None, None


def _gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    # all_gather and reduce_scatter work on dim 0: bring `dim` to the front and back again
    gathered = collectives.all_gather(x.movedim(dim, 0).contiguous(), group=group)
    return gathered.movedim(0, dim).contiguous()


def _reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    mine = collectives.reduce_scatter(x.movedim(dim, 0).contiguous(), group=group)
    return mine.movedim(0, dim).contiguous()


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel: all-gather the sequence forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        # the sequence-parallel pair (Korthikanti et al. 2022): all-gather before a column split,
        # reduce-scatter after a row split; each is the other's mirror in backward
        return _gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # every rank's gradient for the whole sequence is partial (it used only its heads or
        # columns): sum them, and each keeps its own slice of the sequence
        return _reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel: reduce-scatter the sequence forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward (before a column split)."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward (after a row split)."""
    return _ReduceFromParallel.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, group=None, dim: int = -1) -> torch.Tensor:
    """This rank's slice of dimension `dim`, the last by default (backward: all-gather). On
    the sequence, it enters sequence parallelism from a tensor every rank holds whole and
    gets the same gradient for (a replicated embedding's output)."""
    return _ScatterToParallel.apply(x, group, dim)


def gather_from_parallel_region(x: torch.Tensor, group=None, dim: int = -1) -> torch.Tensor:
    """All ranks' slices joined along dimension `dim`, the last by default (backward: keep
    the slice). On the sequence, it leaves sequence parallelism for a layer that every
    rank computes whole (a replicated head): each keeps its own slice's gradient."""
    return _GatherFromParallel.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None,
                                         dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """All-gather along the sequence (dimension `dim`); backward reduce-scatters."""
    return _GatherSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None,
                                               dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Reduce-scatter along the sequence (dimension `dim`); backward all-gathers."""
    return _ReduceScatterSequence.apply(x, group, dim)
