"""Tensor parallelism (Megatron-LM): split the matrices inside a layer across ranks.

For Y = act(X A):
- split A by **columns**: each rank computes a slice of Y's columns with no
  communication, but Y is sharded, so the next layer must accept a sharded input;
- split A by **rows** (X by columns): each rank holds a partial sum of Y, and the
  ranks must all-reduce BEFORE the nonlinearity.

Megatron's MLP does column then row: one all-reduce in the forward pass (operator
g, after the row-parallel layer) and one in the backward (operator f, in front of
the column-parallel layer). The decoder's SwiGLU splits gate and up by columns and
down by rows; its attention splits Q, K, V by heads (columns, whole kv heads with their
query heads) and the output projection by rows, with the same f and g. Sequence
parallelism replaces each all-reduce by a reduce-scatter and an all-gather of the same
volume, so the norm regions between them hold only their slice of the sequence.

Activations are the decoder's [batch, sequence, hidden] (`minipar.decoder`): the
sequence-parallel pair works on dim 1 (`mappings.SEQUENCE_DIM`).
Weights are shards of one master weight: `from_linear` cuts a single-process
`nn.Linear`, so a parallel model and its one-process twin start identical.
"""

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    sum_sequence_parallel_grads_in_backward,
    sync_sequence_parallel_grads,
    twin_slice,
)
from .mappings import (
    SEQUENCE_DIM,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)
from .parallel_block import ParallelAttention, ParallelDecoderBlock, ParallelSwiGLU

__all__ = ["SEQUENCE_DIM", "ColumnParallelLinear", "ParallelAttention",
           "ParallelDecoderBlock", "ParallelSwiGLU", "RowParallelLinear", "copy_to_parallel_region",
           "gather_from_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_from_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_parallel_region", "sum_sequence_parallel_grads_in_backward",
           "sync_sequence_parallel_grads", "twin_slice"]
