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
all_gather and reduce_scatter split and join; the decoder's block (`decoder.py`) keeps
its twin's [batch, sequence, hidden] and passes dim 1 to the sequence-parallel pair.
Weights are shards of one master weight: `from_linear` cuts a single-process
`nn.Linear`, so a parallel model and its one-process twin start identical.
"""

from .decoder import ParallelAttention, ParallelDecoderBlock, ParallelSwiGLU
from .layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTinyGPT,
    ParallelTransformerBlock,
    RowParallelLinear,
    sum_sequence_parallel_grads_in_backward,
    sync_sequence_parallel_grads,
)
from .mappings import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)

__all__ = ["ColumnParallelLinear", "ParallelAttention", "ParallelDecoderBlock", "ParallelMLP",
           "ParallelSelfAttention", "ParallelSwiGLU", "ParallelTinyGPT",
           "ParallelTransformerBlock", "RowParallelLinear", "copy_to_parallel_region",
           "gather_from_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_from_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_parallel_region", "sum_sequence_parallel_grads_in_backward",
           "sync_sequence_parallel_grads"]
