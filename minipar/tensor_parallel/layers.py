"""Tensor-parallel linear layers cut from a single-process `nn.Linear`: column- and
row-parallel, the two pieces every Megatron split is made of (the decoder's attention,
SwiGLU and block are built from them in `parallel_block.py`), and the sums that sequence
parallelism adds for replicated parameters.

`from_linear` cuts a one-process layer, so a parallel model and its twin start identical
and tests hold every output and gradient equal.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import collectives
from ..decoder import RMSNorm
from ..runtime import device
from .mappings import (
    _tp,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)


def _divide(what: str, total: int, parts: int) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}; "
                         f"choose a {what} that is a multiple of {parts}")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A's output features (rows of nn.Linear's weight) split over ranks.

    Input: the full X (f copies it in, and all-reduces its gradient). Output: this
    rank's slice of Y's features, or all of Y with gather_output=True. The bias is
    split with the output features. Under sequence parallelism X arrives as this rank's
    slice of the sequence and is all-gathered first. shared_input=True: the caller has
    already passed X through f (or the all-gather) once for several column layers that
    read it (q, k and v; gate and up), so X's gradient is all-reduced once, as with
    Megatron's fused QKV and fc1 weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, shared_input: bool = False) -> None:
        super().__init__()
        me, size = _tp(group)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, \
            sequence_parallel
        self.shared_input = shared_input
        local = _divide("out_features", out_features, size)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device()))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype, device=device())) if bias else None
        self._rank = me

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False, group=None,
                    sequence_parallel: bool = False, shared_input: bool = False
                    ) -> ColumnParallelLinear:
        """This rank's shard of a single-process layer (same values as the twin)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    gather_output, group, sequence_parallel, linear.weight.dtype,
                    shared_input)
        _, size = _tp(group)
        with torch.no_grad():
            # nn.Linear's weight is [out, in]: a column split of Y = X A^T cuts A's rows (dim 0)
            layer.weight.copy_(linear.weight.chunk(size, dim=0)[layer._rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(size, dim=0)[layer._rank])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sequence parallel: x arrives as this rank's slice of the sequence, so the all-gather
        # stands where f would (Korthikanti et al. 2022)
        if not self.shared_input:
            x = gather_from_sequence_parallel_region(x, self.group) \
                if self.sequence_parallel else copy_to_parallel_region(x, self.group)
        y = nn.functional.linear(x, self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input features (columns of the weight) split over ranks.

    Input: this rank's slice of X's features (input_is_parallel=True, as after a
    column-parallel layer) or the full X, which is then split. Each rank's product is
    a partial sum; g all-reduces it (or, sequence parallel, reduce-scatters it along
    the sequence). The bias is not split: it is added once,
    after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, group=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        me, size = _tp(group)
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, \
            sequence_parallel
        local = _divide("in_features", in_features, size)
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device()))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device())) \
            if bias else None
        self._rank = me

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = False, group=None,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    input_is_parallel, group, sequence_parallel, linear.weight.dtype)
        _, size = _tp(group)
        with torch.no_grad():
            # a row split of the product cuts the input features: dim 1 of the [out, in] weight
            layer.weight.copy_(linear.weight.chunk(size, dim=1)[layer._rank])
            if linear.bias is not None:
                # the whole bias on every rank: it is added once, after the partial sums are reduced
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        # no bias here: each rank's product is a partial sum, and K biases would add up to K x b
        partial = nn.functional.linear(x, self.weight)
        y = reduce_scatter_to_sequence_parallel_region(partial, self.group) \
            if self.sequence_parallel else reduce_from_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


def sequence_parallel_shared(module: nn.Module) -> list[nn.Parameter]:
    """With sequence parallelism, the parameters that are replicated but applied to this
    rank's slice of the sequence (norms, and the biases added after a reduce-scatter): their
    gradients are partial, each covering this rank's tokens, and must be summed over tp."""
    shared = []
    for layer in module.modules():
        if isinstance(layer, (nn.LayerNorm, RMSNorm)):
            shared += list(layer.parameters())
        elif isinstance(layer, RowParallelLinear) and layer.sequence_parallel \
                and layer.bias is not None:
            shared.append(layer.bias)
    return shared


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """Sum over the tensor-parallel ranks the partial gradients of `module`'s
    `sequence_parallel_shared` parameters. Call after backward."""
    for p in sequence_parallel_shared(module):
        if p.grad is not None:
            # a sum, not an average: each rank's partial gradient covers its own slice of tokens
            collectives.all_reduce(p.grad, group=group)


def sum_sequence_parallel_grads_in_backward(module: nn.Module, group=None) -> None:
    """The same sum, done inside backward: each partial gradient is summed over tp as it
    is computed, before it is added into .grad, so a data-parallel wrapper's hooks (which
    fire after that addition and may reduce and free .grad) see the whole gradient. It
    runs once per micro-batch; the norms are vectors, so the extra messages are small."""
    def summed(grad: torch.Tensor) -> torch.Tensor:
        # a copy: the hook must not change autograd's buffer in place
        return collectives.all_reduce(grad.clone(), group=group)

    for p in sequence_parallel_shared(module):
        p.register_hook(summed)


def twin_slice(full: torch.Tensor, local: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The part of a twin's tensor that a tensor-parallel rank holds: whole if the shapes
    agree, else the tp_rank-th chunk along the dimension that was split."""
    if full.shape == local.shape:
        return full
    # column-parallel weights are split along dim 0 (output features), row-parallel ones along
    # the last (input features)
    dim = 0 if full.shape[0] != local.shape[0] else full.dim() - 1
    return full.chunk(tp, dim)[tp_rank]
