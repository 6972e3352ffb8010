"""Attention in pieces: one block of keys at a time, merged with the online-softmax rule.

softmax(s) over all keys can be computed block by block: each block gives its output
(weighted by its own softmax) and the log-sum-exp of its scores, and two partial results
merge exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

This is what lets ring attention (and FlashAttention, inside one device) never hold the
whole score matrix. Positions are global token indices, so a causal mask is right
whichever slice of the sequence a rank holds.
"""

from __future__ import annotations

import math

import torch

from ..runtime import device


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Plain softmax(q k^T / sqrt(d)) v over [..., S, D] tensors: the one-process reference.
    Causal: a query attends to keys at positions <= its own (positions default to 0..S-1)."""
    # 1 / sqrt(d): "Attention Is All You Need"'s scaling, keeping the scores' variance near 1
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        q_pos = torch.arange(q.shape[-2], device=q.device) if q_pos is None else q_pos
        k_pos = torch.arange(k.shape[-2], device=k.device) if k_pos is None else k_pos
        # -inf before the softmax, not 0 after it: exp(-inf) = 0 and the rest still sums to 1
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: int,
                      causal: bool = False) -> torch.Tensor:
    """One process, the ring's arithmetic without the ring: queries and keys cut into
    `blocks` chunks, each query chunk merging its key chunks by the online softmax, the
    chunks wholly in its future skipped. The fair one-process baseline for ring
    attention (the same blocks, the same skipped work); FlashAttention tiles the same way
    inside one device."""
    seq = q.shape[-2]
    pos = torch.arange(seq, device=device())
    cuts = torch.tensor_split(pos, blocks)
    outs = []
    for q_pos in cuts:
        # tensor_split's cuts are contiguous runs, so a slice from first to last covers each
        qs = slice(int(q_pos[0]), int(q_pos[-1]) + 1)
        out = lse = None
        for k_pos in cuts:
            if fully_masked(q_pos, k_pos, causal):
                continue
            ks = slice(int(k_pos[0]), int(k_pos[-1]) + 1)
            o, lse_b = block_attention(q[..., qs, :], k[..., ks, :], v[..., ks, :], q_pos,
                                       k_pos, causal)
            out, lse = (o, lse_b) if out is None else merge(out, lse, o, lse_b)
        outs.append(out)
    return torch.cat(outs, dim=-2)


def fully_masked(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> bool:
    """True when no query may see any key of the block: the block's work can be skipped."""
    return causal and bool(k_pos.min() > q_pos.max())


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of keys: (output under this block's own softmax, log-sum-exp of the
    scores per query). A query that sees no key of the block gets output 0, lse -inf."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    # logsumexp subtracts the row's max before exp, so large scores cannot overflow
    lse = torch.logsumexp(scores, dim=-1)
    # exp(s - lse) is the softmax itself: the division by the row's sum is folded into lse
    weights = torch.exp(scores - _finite(lse).unsqueeze(-1))  # masked rows: exp(-inf) = 0
    return weights @ v, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results over disjoint key blocks -> the result over both."""
    # logaddexp(a, b) = log(exp(a) + exp(b)), computed without overflow
    lse = torch.logaddexp(lse_a, lse_b)
    # both blocks masked: lse is -inf, and -inf - (-inf) would be NaN; subtracting 0 instead
    # keeps the row's output at 0
    safe = _finite(lse)
    out = out_a * torch.exp(lse_a - safe).unsqueeze(-1) + \
        out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, lse


def block_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, causal: bool, lse: torch.Tensor, dout: torch.Tensor,
                    delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the final lse of every query and
    delta = rowsum(dout * out): the softmax is rebuilt from lse, never stored whole.
    With p = exp(s - lse): dv = p^T dout, ds = p * (dout v^T - delta), dq = ds k / sqrt(d),
    dk = ds^T q / sqrt(d)."""
    scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    # the final lse, not this block's: p is this block's slice of the whole row's softmax
    # (FlashAttention's backward recomputes it the same way, Dao et al. 2022)
    p = torch.exp(scores - _finite(lse).unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    # softmax's backward: rowsum(p * dp) equals rowsum(dout * out), so delta is computed once
    ds = p * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def positions(rank: int, world_size: int, seq_len: int, balanced: bool) -> torch.Tensor:
    """The global positions of the tokens `rank` holds. Contiguous: slice `rank` of
    `world_size`. Balanced (for causal attention): the sequence cut into 2K chunks, rank r
    holding chunks r and 2K-1-r, so every rank has as many early (cheap) as late
    (expensive) queries."""
    parts = 2 * world_size if balanced else world_size
    if seq_len % parts:
        how = (f"2 x ranks = {parts} (balanced layout)" if balanced else f"the {parts} ranks")
        raise ValueError(f"sequence length {seq_len} must be divisible by {how}; pad it to "
                         f"{math.ceil(seq_len / parts) * parts} or use another length")
    c = seq_len // parts
    if not balanced:
        return torch.arange(rank * c, (rank + 1) * c, device=device())
    # the zig-zag layout of Megatron's context parallelism: chunk r (cheap) pairs with chunk
    # 2K-1-r (expensive), so causal work is even over the ranks
    mirror = parts - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device()),
                      torch.arange(mirror * c, (mirror + 1) * c, device=device())])


def chunks(pos: torch.Tensor, balanced: bool) -> list[slice]:
    """The contiguous runs of a rank's positions (two in the balanced layout): the unit at
    which causal work is skipped."""
    if not balanced:
        return [slice(0, len(pos))]
    half = len(pos) // 2
    return [slice(0, half), slice(half, len(pos))]
