"""The decoder's attention over a context-parallel group: each rank holds the tokens of
the balanced (zig-zag) layout, `attention.positions(rank, cp, seq_len, balanced=True)`,
and its attention core runs ring attention (`ring_core`) or Ulysses (`ulysses_core`)
instead of attending locally: the trainer's `parallel.cp_kind` picks one of `CP_CORES`.

Everything else in a block is per token (norms, projections, SwiGLU), so it runs on the
rank's tokens unchanged; RoPE rotates each token by its global position, which is why
the rotary tables are built from the rank's positions rather than 0..seq_len/cp-1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..decoder import grouped_query_attention, repeat_kv
from .ring import ring_attention
from .ulysses import ulysses_attention


def _ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, explicit: bool,
                 group) -> torch.Tensor:
    # ring attention is written out block by block: there is no fused kernel to bypass, so
    # `explicit` changes nothing here
    return ring_attention(q, *repeat_kv(q, k, v), causal=True, balanced=True, group=group)


def _ulysses_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, explicit: bool,
                    group) -> torch.Tensor:
    # the kv heads travel as they are (replicated only if cp exceeds them) and are repeated
    # for their query heads after the all-to-all; the attention is the reference's
    return ulysses_attention(q, k, v, causal=True, balanced=True, group=group)


def ring_core(group) -> Callable[..., torch.Tensor]:
    """An attention core (`Attention.core`'s signature) whose keys and values travel the
    ring of `group`: grouped-query attention's head split, RoPE and kv-head repeat, then
    causal ring attention over the balanced layout."""
    return partial(grouped_query_attention, attend=partial(_ring_attend, group=group))


def ulysses_core(group) -> Callable[..., torch.Tensor]:
    """An attention core that trades the sequence split for a head split over `group`
    (DeepSpeed-Ulysses): grouped-query attention's head split and RoPE on this rank's
    tokens, an all-to-all to whole sequences of H/cp heads, causal attention, and back."""
    return partial(grouped_query_attention, attend=partial(_ulysses_attend, group=group))


# the trainer's parallel.cp_kind: how a context-parallel group attends
CP_CORES = {"ring": ring_core, "ulysses": ulysses_core}
