"""Tensor parallelism (Megatron-LM): split the matrices inside a layer across ranks.

For Y = act(X A):
- split A by **columns**: each rank computes a slice of Y's columns with no
  communication, but Y is sharded, so the next layer must accept a sharded input;
- split A by **rows** (X by columns): each rank holds a partial sum of Y, and the
  ranks must all-reduce BEFORE the nonlinearity.

Megatron's MLP does column then row: one all-reduce in the forward pass (operator
g, after the row-parallel layer) and one in the backward (operator f, in front of
the column-parallel layer). Attention splits Q, K, V by heads (columns) and the
output projection by rows, with the same f and g. Sequence parallelism replaces each
all-reduce by a reduce-scatter and an all-gather of the same volume, so the norm and
dropout regions between them hold only their slice of the sequence.

Activations are [sequence, batch, hidden], so the sequence is dim 0, which minipar's
all_gather and reduce_scatter split and join. Weights are shards of one master
weight: `from_linear` cuts a single-process `nn.Linear`, so a parallel model and its
one-process twin start identical.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .models import FFN
from .runtime import rank, world_size


def _tp(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) inside the tensor-parallel group."""
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else \
        (rank(), world_size())


def _last_dim_gather(x: torch.Tensor, group) -> torch.Tensor:
    moved = x.movedim(-1, 0).contiguous()
    gathered = collectives.all_gather(moved, group=group)
    return gathered.movedim(0, -1).contiguous()


def _last_dim_slice(x: torch.Tensor, group) -> torch.Tensor:
    me, size = _tp(group)
    return x.chunk(size, dim=-1)[me].contiguous()


# --- the mappings, as autograd functions ---

class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad.contiguous().clone(), group=ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return collectives.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _last_dim_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _last_dim_gather(grad, ctx.group), None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _last_dim_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _last_dim_slice(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel: all-gather the sequence forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return collectives.all_gather(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.reduce_scatter(grad.contiguous(), group=ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel: reduce-scatter the sequence forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return collectives.reduce_scatter(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad.contiguous(), group=ctx.group), None


def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward (before a column split)."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward (after a row split)."""
    return _ReduceFromParallel.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dimension (backward: all-gather)."""
    return _ScatterToParallel.apply(x, group)


def gather_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All ranks' slices joined along the last dimension (backward: keep the slice)."""
    return _GatherFromParallel.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the sequence (dim 0); backward reduce-scatters."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along the sequence (dim 0); backward all-gathers."""
    return _ReduceScatterSequence.apply(x, group)


# --- layers ---

def _divide(what: str, total: int, parts: int) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}; "
                         f"choose a {what} that is a multiple of {parts}")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A's output features (rows of nn.Linear's weight) split over ranks.

    Input: the full X (f copies it in, and all-reduces its gradient). Output: this
    rank's slice of Y's features, or all of Y with gather_output=True. The bias is
    split with the output features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        me, size = _tp(group)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, \
            sequence_parallel
        local = _divide("out_features", out_features, size)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype)) if bias else None
        self._rank = me

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False, group=None,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's shard of a single-process layer (same values as the twin)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    gather_output, group, sequence_parallel, linear.weight.dtype)
        _, size = _tp(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(size, dim=0)[layer._rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(size, dim=0)[layer._rank])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence_parallel_region(x, self.group) if self.sequence_parallel \
            else copy_to_parallel_region(x, self.group)
        y = nn.functional.linear(x, self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input features (columns of the weight) split over ranks.

    Input: this rank's slice of X's features (input_is_parallel=True, as after a
    column-parallel layer) or the full X, which is then split. Each rank's product is
    a partial sum; g all-reduces it (or, sequence parallel, reduce-scatters it along
    the sequence). The bias is not split: it is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, group=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        me, size = _tp(group)
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, \
            sequence_parallel
        local = _divide("in_features", in_features, size)
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self._rank = me

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = False, group=None,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    input_is_parallel, group, sequence_parallel, linear.weight.dtype)
        _, size = _tp(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(size, dim=1)[layer._rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        partial = nn.functional.linear(x, self.weight)
        y = reduce_scatter_to_sequence_parallel_region(partial, self.group) \
            if self.sequence_parallel else reduce_from_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


# --- blocks ---

MLP = FFN  # the single-process twin of ParallelMLP


class ParallelMLP(nn.Module):
    """Column-parallel up projection, GELU on the local slice, row-parallel down projection:
    one all-reduce forward (g), one backward (f)."""

    def __init__(self, twin: MLP, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.up = ColumnParallelLinear.from_linear(twin.up, group=group,
                                                   sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear.from_linear(twin.down, input_is_parallel=True, group=group,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class SelfAttention(nn.Module):
    """The single-process twin: causal multi-head attention on [seq, batch, hidden]."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(_attend(self.qkv(x), self.heads))


def _attend(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention given [s, b, 3 * heads * d] packed as (head, q|k|v, d)."""
    s, b, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.view(s, b, heads, 3, d).permute(3, 1, 2, 0, 4)  # each [b, heads, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
    weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (weights @ v).permute(2, 0, 1, 3).reshape(s, b, heads * d)


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
        return self.proj(_attend(self.qkv(x), self.heads))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then + mlp(ln(x)). The single-process twin."""

    def __init__(self, hidden: int, heads: int, ffn: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.attn = SelfAttention(hidden, heads, dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.mlp = MLP(hidden, ffn, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelTransformerBlock(nn.Module):
    """The same block, tensor parallel. With sequence_parallel=True, x is this rank's
    slice of the sequence and the norms run on that slice only; the norms' weight
    gradients are then partial and `sync_sequence_parallel_grads` all-reduces them."""

    def __init__(self, twin: TransformerBlock, group=None, sequence_parallel: bool = False
                 ) -> None:
        super().__init__()
        import copy

        self.group, self.sequence_parallel = group, sequence_parallel
        self.ln1, self.ln2 = copy.deepcopy(twin.ln1), copy.deepcopy(twin.ln2)
        self.attn = ParallelSelfAttention(twin.attn, group, sequence_parallel)
        self.mlp = ParallelMLP(twin.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def sync_sequence_parallel_grads(self) -> None:
        sync_sequence_parallel_grads(self, self.group)


class TinyGPT(nn.Module):
    """The single-process twin: token + position embeddings, blocks, a final norm and an
    output head tied to the token embedding; input [sequence, batch] token ids."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2,
                 seq_len: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(vocab, hidden, dtype=dtype)
        self.positions = nn.Embedding(seq_len, hidden, dtype=dtype)
        self.blocks = nn.ModuleList(TransformerBlock(hidden, heads, 4 * hidden, seed + 1 + i,
                                                     dtype) for i in range(layers))
        self.norm = nn.LayerNorm(hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[0]))[:, None, :]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.t()  # logits [sequence, batch, vocab]


class ParallelTinyGPT(nn.Module):
    """The same GPT with tensor-parallel blocks; embeddings, final norm and the tied head
    stay replicated (their gradients come out equal on every rank, since every rank sees
    the full activations after each block's g)."""

    def __init__(self, twin: TinyGPT, group=None) -> None:
        super().__init__()
        import copy

        self.tokens, self.positions = copy.deepcopy(twin.tokens), copy.deepcopy(twin.positions)
        self.blocks = nn.ModuleList(ParallelTransformerBlock(b, group) for b in twin.blocks)
        self.norm = copy.deepcopy(twin.norm)

    forward = TinyGPT.forward


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """With sequence parallelism, parameters that are replicated but applied to this rank's
    slice of the sequence (norms, and the biases added after a reduce-scatter) get partial
    gradients: sum them over the tensor-parallel ranks. Call after backward."""
    shared = []
    for layer in module.modules():
        if isinstance(layer, nn.LayerNorm):
            shared += list(layer.parameters())
        elif isinstance(layer, RowParallelLinear) and layer.sequence_parallel \
                and layer.bias is not None:
            shared.append(layer.bias)
    for p in shared:
        if p.grad is not None:
            collectives.all_reduce(p.grad, group=group)


# ------------------------------------------------------------------ demo run ---

def _demo() -> list[tuple[str, bool]]:
    from .runtime import device

    report = []
    for sequence_parallel in (False, True):
        twin = TransformerBlock(64, 4, 256, seed=0, dtype=torch.float64).to(device())
        block = ParallelTransformerBlock(twin, sequence_parallel=sequence_parallel)
        x = torch.randn(16, 2, 64, dtype=torch.float64, device=device(),
                        generator=torch.Generator(device=device()).manual_seed(1))
        k, me = world_size(), rank()
        local = x.chunk(k, 0)[me].contiguous() if sequence_parallel else x
        expected = twin(x).chunk(k, 0)[me] if sequence_parallel else twin(x)
        report.append((f"block{' (sequence parallel)' if sequence_parallel else ''}",
                       bool(torch.allclose(block(local), expected))))
    return report


def main(argv: list[str] | None = None) -> None:
    """python -m minipar.tensor_parallel --ranks 2, or under torchrun (NCCL on GPUs)."""
    from .runtime import demo_parser, launch

    parser = demo_parser("A tensor-parallel block vs its twin", 2)
    args = parser.parse_args(argv)
    results = launch(_demo, args.ranks, backend=args.backend)
    if rank() == 0:
        for r, report in enumerate(results):
            for name, same in report:
                print(f"rank {r}: {name} equals its one-process twin: {same}")


if __name__ == "__main__":
    main()
