"""All-to-all sequence parallelism (DeepSpeed-Ulysses): trade the sequence split for a
head split, attend with whole sequences, trade back.

Each of K ranks holds [B, H, S/K, D] of q, k and v. One all-to-all per tensor turns that
into [B, H/K, S, D]: rank r gets heads r*H/K.. of every token. Attention per head needs
nothing from other heads, so each rank attends alone; one more all-to-all returns the
output to the sequence split. Four all-to-alls, each moving (K-1)/K of a rank's tensor,
against ring attention's K-1 key/value blocks; but K must divide the number of heads
(of key/value heads, with grouped-query attention). `balanced` only names the input
layout: Ulysses' attention is whole-sequence per head, balanced by construction.
"""

from __future__ import annotations

import torch

from .. import collectives
from ..runtime import world_size
from .attention import attention, positions


def _exchange(x: torch.Tensor, split: int, join: int, group) -> torch.Tensor:
    """Cut dim `split` into K pieces, send piece j to rank j, and join what arrives (in
    source-rank order) along dim `join`."""
    k = world_size(group)
    if k == 1:
        return x
    pieces = torch.stack(torch.chunk(x, k, dim=split))  # [K, ...]: piece j for rank j
    # one row of the stacked [K, ...] tensor per rank each way; contiguous, as chunk's pieces
    # of an inner dim are strided views
    received = collectives.all_to_all(pieces.contiguous(), [1] * k, [1] * k, group)
    return torch.cat(list(received), dim=join)


class _Reshard(torch.autograd.Function):
    """Split dim `split`, join along dim `join` across the ranks; the gradient goes back
    the other way (join split, split joined). Heads are dim 1, the sequence dim 2:
    (1, 2) turns [B, H, S/K, D] into [B, H/K, S, D], and (2, 1) turns it back."""

    @staticmethod
    def forward(ctx, x, split, join, group):
        ctx.dims, ctx.group = (split, join), group
        return _exchange(x, split, join, group)

    @staticmethod
    def backward(ctx, grad):
        split, join = ctx.dims
        # an all-to-all's adjoint is the all-to-all the other way: swap split and join
        return _exchange(grad.contiguous(), join, split, ctx.group), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      balanced: bool = False, group=None) -> torch.Tensor:
    """Attention of this rank's [B, H, S/K, D] slice (positions as `attention.positions`
    lays them out) by re-sharding to heads and back; heads must divide by K."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k and v must be [batch, heads, tokens, head_dim] of one shape; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    size = world_size(group)
    if q.shape[1] % size:
        raise ValueError(f"Ulysses splits the {q.shape[1]} heads over {size} ranks; use a "
                         f"number of ranks that divides the heads (or ring_attention)")
    seq_len = q.shape[2] * size
    # after the exchange the tokens come in rank order; positions say where each belongs
    pos = torch.cat([positions(r, size, seq_len, balanced) for r in range(size)])
    qh, kh, vh = (_Reshard.apply(t.contiguous(), 1, 2, group) for t in (q, k, v))
    # whole sequences per head: the causal mask needs only the global positions
    out = attention(qh, kh, vh, causal, pos, pos)
    return _Reshard.apply(out, 2, 1, group)
