"""Text out of the trained decoder: sampling, one token at a time, with a key/value cache.

Without a cache every new token reruns the whole window. With one, each layer keeps the
rotated keys and values of the tokens it has seen (per kv head, before grouped-query
attention repeats them: a cache heads / kv_heads times smaller than multi-head
attention's), and a step computes the newest token only, its position running on from
the cache's length. Past `seq_len` tokens, the positions the model was trained on, the
window slides: every position shifts, so the cache is rebuilt from the window, and each
step then costs what an uncached one does. The tokens are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch

from .decoder import Decoder, grouped_query_attention


class KVCache:
    """Each layer's keys and values so far, [batch, kv_heads, tokens, head_dim]."""

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    def __len__(self) -> int:
        """Tokens held (every layer holds the same ones)."""
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def clear(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)

    def keeper(self, layer: int) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
        """`grouped_query_attention`'s `keep` for `layer`: append this call's keys and
        values, return all of them."""
        def keep(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self.keys[layer] is not None:
                k = torch.cat([self.keys[layer], k], dim=-2)
                v = torch.cat([self.values[layer], v], dim=-2)
            self.keys[layer], self.values[layer] = k, v
            return k, v
        return keep


@contextmanager
def caching(model: Decoder, cache: KVCache) -> Iterator[None]:
    """Inside the block, every layer's attention core keeps its keys and values in `cache`
    (through `Attention.core`, the extension point); the cores are restored after."""
    saved = [vars(block.attn).get("core") for block in model.blocks]
    try:
        for i, block in enumerate(model.blocks):
            block.attn.core = partial(grouped_query_attention, keep=cache.keeper(i))
        yield
    finally:
        for block, core in zip(model.blocks, saved, strict=True):
            if core is None:
                del block.attn.core  # back to the class's own core
            else:
                block.attn.core = core


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [batch, vocab]: greedy at temperature 0, else drawn
    from the softmax of logits / temperature over the `top_k` largest."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        # keep the k largest; the rest get -inf, so zero probability
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model: Decoder, ids: torch.Tensor, new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None
             ) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to ids [batch, seq], with a key/value cache."""
    window, cache = model.config.seq_len, KVCache(len(model.blocks))
    pending = ids[:, -window:]  # the tokens the cache has not seen: first, the prompt
    with caching(model, cache):
        for _ in range(new_tokens):
            if len(cache) + pending.shape[1] > window:  # past the trained positions: slide
                cache.clear()
                pending = ids[:, -window:]
            past = len(cache)
            positions = torch.arange(past, past + pending.shape[1], device=ids.device)
            logits = model(pending, positions)[:, -1, :].float()
            pending = sample_next(logits, temperature, top_k, generator).to(ids.dtype)
            ids = torch.cat([ids, pending], dim=1)
    return ids
