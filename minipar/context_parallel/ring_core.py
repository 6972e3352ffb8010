"""The decoder's attention over a context-parallel group: each rank holds the tokens of
the balanced (zig-zag) layout, `attention.positions(rank, cp, seq_len, balanced=True)`,
and its attention core runs ring attention instead of attending locally.

Everything else in a block is per token (norms, projections, SwiGLU), so it runs on the
rank's tokens unchanged; RoPE rotates each token by its global position, which is why
the rotary tables are built from the rank's positions rather than 0..seq_len/cp-1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..decoder import grouped_query_attention
from .ring import ring_attention


def _ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, explicit: bool,
                 group) -> torch.Tensor:
    # ring attention is written out block by block: there is no fused kernel to bypass, so
    # `explicit` changes nothing here
    return ring_attention(q, k, v, causal=True, balanced=True, group=group)


def ring_core(group) -> Callable[..., torch.Tensor]:
    """An attention core (`Attention.core`'s signature) whose keys and values travel the
    ring of `group`: grouped-query attention's head split, RoPE and kv-head repeat, then
    causal ring attention over the balanced layout."""
    return partial(grouped_query_attention, attend=partial(_ring_attend, group=group))
