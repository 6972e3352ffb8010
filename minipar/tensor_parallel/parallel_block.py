"""The decoder's block (`minipar.decoder`), tensor and sequence parallel: grouped-query
attention split by kv heads, SwiGLU split by its inner width, norms replicated.

Each class is cut from its single-process twin, so tests hold every output and gradient
equal to the twin's. The twin's layout is [batch, seq, hidden]: under sequence
parallelism each rank holds x[:, its slice of the sequence, :].
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..decoder import Attention, DecoderBlock, SwiGLU, grouped_query_attention
from .layers import ColumnParallelLinear, RowParallelLinear, sync_sequence_parallel_grads
from .mappings import _tp, copy_to_parallel_region, gather_from_sequence_parallel_region


def _enter_parallel_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Once for all the column-parallel layers that read x: f (identity forward,
    all-reduce backward) or, sequence parallel, the all-gather of the sequence."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_parallel_region(x, group)


def _check_heads(heads: int, kv_heads: int, size: int) -> None:
    if heads % size or kv_heads % size:
        works = [t for t in range(1, math.gcd(heads, kv_heads) + 1)
                 if heads % t == 0 and kv_heads % t == 0]
        raise ValueError(f"tensor-parallel size tp={size} must divide heads={heads} and "
                         f"kv_heads={kv_heads}; tp in {works} would work")


class ParallelAttention(nn.Module):
    """Grouped-query attention with its heads split over ranks: rank r holds kv heads
    [r*kv/tp, (r+1)*kv/tp) and exactly the query heads they serve, attends locally with
    the twin's code, and the row-parallel o_proj sums the heads' contributions (g). `core`
    is the twin's extension point, kept: recomputation or ring attention replace it."""

    core = staticmethod(grouped_query_attention)

    def __init__(self, twin: Attention, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        _, size = _tp(group)
        # kv head j serves the consecutive query heads j*g .. j*g+g-1, so cutting the query
        # heads and the kv heads into the same tp contiguous chunks keeps every query head on
        # the rank of its kv head: hence tp must divide kv_heads (and so heads), not only heads
        _check_heads(twin.heads, twin.kv_heads, size)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.heads, self.kv_heads = twin.heads // size, twin.kv_heads // size  # local counts
        self.head_dim, self.explicit = twin.head_dim, twin.explicit

        def column(linear: nn.Linear) -> ColumnParallelLinear:
            # a contiguous chunk of output features is a contiguous run of whole heads
            return ColumnParallelLinear.from_linear(linear, group=group, shared_input=True)

        self.q_proj, self.k_proj, self.v_proj = (column(twin.q_proj), column(twin.k_proj),
                                                 column(twin.v_proj))
        self.o_proj = RowParallelLinear.from_linear(twin.o_proj, input_is_parallel=True,
                                                    group=group,
                                                    sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                explicit: bool | None = None) -> torch.Tensor:
        """x [batch, seq, hidden] (sequence parallel: this rank's slice of seq); cos and sin
        cover the whole sequence: they are per position and head_dim, the same on every
        rank, so RoPE applies to the local heads unchanged."""
        x = _enter_parallel_region(x, self.group, self.sequence_parallel)
        out = self.core(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin,
                        self.head_dim, self.explicit if explicit is None else explicit)
        return self.o_proj(out)


class ParallelSwiGLU(nn.Module):
    """gate and up column-parallel, down row-parallel: as Megatron's MLP, one g forward
    (after down) and one f backward (before gate and up)."""

    def __init__(self, twin: SwiGLU, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gate = ColumnParallelLinear.from_linear(twin.gate, group=group, shared_input=True)
        self.up = ColumnParallelLinear.from_linear(twin.up, group=group, shared_input=True)
        self.down = RowParallelLinear.from_linear(twin.down, input_is_parallel=True, group=group,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter_parallel_region(x, self.group, self.sequence_parallel)
        # silu and the product are elementwise: gate's and up's column slices line up, so
        # they combine locally with no communication
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class ParallelDecoderBlock(nn.Module):
    """The twin's pre-norm block with ParallelAttention and ParallelSwiGLU. With
    sequence_parallel=True, x is this rank's slice of the sequence (dim 1) and the norms run
    on that slice only (Korthikanti et al. 2022); their weight gradients are then partial:
    call `sync_sequence_parallel_grads` after backward."""

    def __init__(self, twin: DecoderBlock, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        # replicated, not split: an RMSNorm needs a token's whole hidden vector, which every
        # rank has (all features, or all of its own tokens' features under sequence parallelism)
        self.attn_norm, self.mlp_norm = copy.deepcopy(twin.attn_norm), copy.deepcopy(twin.mlp_norm)
        self.attn = ParallelAttention(twin.attn, group, sequence_parallel)
        self.mlp = ParallelSwiGLU(twin.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                explicit: bool | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, explicit)
        return x + self.mlp(self.mlp_norm(x))

    def sync_sequence_parallel_grads(self) -> None:
        sync_sequence_parallel_grads(self, self.group)
