"""Tensor-parallel layers cut from single-process twins: column- and row-parallel linear
layers, Megatron's MLP and attention, a transformer block and a tiny GPT.

Each parallel layer is built from its twin in `minipar.models` (`from_linear` cuts a
one-process `nn.Linear`), so a parallel model and its twin start identical and tests
hold every output and gradient equal.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import collectives
from ..decoder import RMSNorm
from ..models import FFN, SelfAttention, TinyGPT, TransformerBlock, attend
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
    split with the output features. `sequence_dim` is where the sequence-parallel
    all-gather joins the sequence (0: [seq, batch, hidden]; 1: the decoder's layout).
    shared_input=True: the caller has already passed X through f (or the all-gather) once
    for several column layers that read it (q, k and v; gate and up), so X's gradient is
    all-reduced once, as with Megatron's fused QKV and fc1 weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, sequence_dim: int = 0,
                 shared_input: bool = False) -> None:
        super().__init__()
        me, size = _tp(group)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, \
            sequence_parallel
        self.sequence_dim, self.shared_input = sequence_dim, shared_input
        local = _divide("out_features", out_features, size)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype)) if bias else None
        self._rank = me

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False, group=None,
                    sequence_parallel: bool = False, sequence_dim: int = 0,
                    shared_input: bool = False) -> ColumnParallelLinear:
        """This rank's shard of a single-process layer (same values as the twin)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    gather_output, group, sequence_parallel, linear.weight.dtype,
                    sequence_dim, shared_input)
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
            x = gather_from_sequence_parallel_region(x, self.group, self.sequence_dim) \
                if self.sequence_parallel else copy_to_parallel_region(x, self.group)
        y = nn.functional.linear(x, self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input features (columns of the weight) split over ranks.

    Input: this rank's slice of X's features (input_is_parallel=True, as after a
    column-parallel layer) or the full X, which is then split. Each rank's product is
    a partial sum; g all-reduces it (or, sequence parallel, reduce-scatters it along
    the sequence, dimension `sequence_dim`). The bias is not split: it is added once,
    after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, group=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, sequence_dim: int = 0) -> None:
        super().__init__()
        me, size = _tp(group)
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, \
            sequence_parallel
        self.sequence_dim = sequence_dim
        local = _divide("in_features", in_features, size)
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self._rank = me

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = False, group=None,
                    sequence_parallel: bool = False, sequence_dim: int = 0
                    ) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    input_is_parallel, group, sequence_parallel, linear.weight.dtype,
                    sequence_dim)
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
        y = reduce_scatter_to_sequence_parallel_region(partial, self.group, self.sequence_dim) \
            if self.sequence_parallel else reduce_from_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


class ParallelMLP(nn.Module):
    """Column-parallel up projection, GELU on the local slice, row-parallel down projection:
    one all-reduce forward (g), one backward (f)."""

    def __init__(self, twin: FFN, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.up = ColumnParallelLinear.from_linear(twin.up, group=group,
                                                   sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear.from_linear(twin.down, input_is_parallel=True, group=group,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GELU is elementwise, so it runs on the column slice with no communication: the reason
        # Megatron (Shoeybi et al. 2019) splits the first matrix by columns and the second by rows
        return self.down(nn.functional.gelu(self.up(x)))


class ParallelSelfAttention(nn.Module):
    """Heads split over ranks: a column-parallel QKV gives each rank whole heads (the
    packed layout keeps each head's q, k, v together), attention runs locally, and a
    row-parallel output projection sums the heads' contributions (g)."""

    def __init__(self, twin: SelfAttention, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        _, size = _tp(group)
        self.heads = _divide("heads", twin.heads, size)
        self.qkv = ColumnParallelLinear.from_linear(twin.qkv, group=group,
                                                    sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(twin.proj, input_is_parallel=True,
                                                  group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.qkv(x), self.heads))


class ParallelTransformerBlock(nn.Module):
    """The same block, tensor parallel. With sequence_parallel=True, x is this rank's
    slice of the sequence and the norms run on that slice only; the norms' weight
    gradients are then partial and `sync_sequence_parallel_grads` all-reduces them."""

    def __init__(self, twin: TransformerBlock, group=None, sequence_parallel: bool = False
                 ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        # the norms are replicated, not split: each rank needs the full hidden vector's mean and
        # variance, which it has (whole features, or whole rows under sequence parallelism)
        self.ln1, self.ln2 = copy.deepcopy(twin.ln1), copy.deepcopy(twin.ln2)
        self.attn = ParallelSelfAttention(twin.attn, group, sequence_parallel)
        self.mlp = ParallelMLP(twin.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def sync_sequence_parallel_grads(self) -> None:
        sync_sequence_parallel_grads(self, self.group)


class ParallelTinyGPT(nn.Module):
    """The same GPT with tensor-parallel blocks; embeddings, final norm and the tied head
    stay replicated (their gradients come out equal on every rank, since every rank sees
    the full activations after each block's g)."""

    def __init__(self, twin: TinyGPT, group=None) -> None:
        super().__init__()
        self.tokens, self.positions = copy.deepcopy(twin.tokens), copy.deepcopy(twin.positions)
        self.blocks = nn.ModuleList(ParallelTransformerBlock(b, group) for b in twin.blocks)
        self.norm = copy.deepcopy(twin.norm)

    # the twin's forward itself: it only reads tokens, positions, blocks and norm
    forward = TinyGPT.forward


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
