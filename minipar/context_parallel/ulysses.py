"""All-to-all sequence parallelism (DeepSpeed-Ulysses): trade the sequence split for a
head split, attend with whole sequences, trade back.

Each of K ranks holds [B, H, S/K, D] of q, k and v. One all-to-all per tensor turns that
into [B, H/K, S, D]: rank r gets heads r*H/K.. of every token. Attention per head needs
nothing from other heads, so each rank attends alone; one more all-to-all returns the
output to the sequence split. Four all-to-alls, each moving (K-1)/K of a rank's tensor,
against ring attention's K-1 key/value blocks; but K must divide the number of heads.
`balanced` only names the input layout: Ulysses' attention is whole-sequence per head,
balanced by construction.

With grouped-query attention k and v have fewer heads than q (KV, each serving H/KV
consecutive query heads), and they travel before they are repeated, so the exchange
moves KV heads, not H. If K divides KV, rank r gets kv heads r*KV/K.., exactly the ones
its query heads need. If K exceeds KV (eight ranks, two kv heads), there are not enough
kv heads to go round: each is first replicated K/KV times, so every rank receives the one
copy its query heads use (verl#1226). K must then be a multiple of KV.
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


def check_heads(heads: int, kv_heads: int, ranks: int, where: str = "") -> None:
    """One line (after `where`) if Ulysses cannot split these heads over `ranks`: the query
    heads must divide by it, and the kv heads divide by it or divide it (then they are
    replicated)."""
    if heads % ranks:
        raise ValueError(f"{where}Ulysses splits the {heads} heads over {ranks} ranks; use a "
                         "number of ranks that divides the heads (or ring attention)")
    if kv_heads % ranks and ranks % kv_heads:
        raise ValueError(f"{where}Ulysses splits {kv_heads} kv heads over {ranks} ranks: use "
                         "a number of ranks that divides them or is a multiple of them")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      balanced: bool = False, group=None) -> torch.Tensor:
    """Attention of this rank's [B, H, S/K, D] slice of q (positions as
    `attention.positions` lays them out) and [B, KV, S/K, D] of k and v (KV = H without
    grouped-query attention) by re-sharding to heads and back; K must divide the heads,
    and KV or a multiple of it (module docstring)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] \
            or k.shape[2:] != q.shape[2:] or k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [batch, heads, tokens, head_dim] and k, v one shape with "
                         f"kv heads dividing q's heads; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    size, heads, kv_heads = world_size(group), q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, size)
    if kv_heads % size:
        # fewer kv heads than ranks: a copy of each kv head for every rank its queries reach
        k, v = k.repeat_interleave(size // kv_heads, 1), v.repeat_interleave(size // kv_heads, 1)
    seq_len = q.shape[2] * size
    # after the exchange the tokens come in rank order; positions say where each belongs
    pos = torch.cat([positions(r, size, seq_len, balanced) for r in range(size)])
    qh, kh, vh = (_Reshard.apply(t.contiguous(), 1, 2, group) for t in (q, k, v))
    # this rank's query heads are consecutive, and so are the kv heads they use: repeat
    # each for its local query heads, as grouped_query_attention does on one process
    group_size = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group_size, 1), vh.repeat_interleave(group_size, 1)
    # whole sequences per head: the causal mask needs only the global positions
    out = attention(qh, kh, vh, causal, pos, pos)
    return _Reshard.apply(out, 2, 1, group)
