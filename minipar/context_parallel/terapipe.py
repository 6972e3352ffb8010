"""TeraPipe (Li et al. 2021): pipeline one sequence's tokens instead of a batch's samples.

A causal transformer's token t depends only on tokens <= t, so a sequence cut into
slices can flow through the pipeline stages slice after slice, even with a batch of
one. Each stage caches the keys and values of the slices it has seen; a later slice's
queries attend to them. Backward runs from the last slice to the first (the `terapipe`
schedule): slice j's backward produces a share of every earlier slice's key/value
gradient, which that slice's own backward then carries through its graph.

Later tokens attend to more, so equal slices do not cost the same; `best_slices` picks
uneven ones by dynamic programming, minimising the pipeline's latency
sum(t_i) + (stages - 1) * max(t_i).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..decoder import (
    Decoder,
    DecoderConfig,
    cross_entropy,
    decoder,
    grouped_query_attention,
    rope_tables,
)
from ..runtime import device


class TokenStage(nn.Module):
    """Blocks `first..last-1` of a decoder twin, fed one slice of a sequence at a time,
    with a key/value cache per block. The first stage takes token ids [slice, batch] (the
    sequence first, so the pipeline engine cuts slices along dim 0) and embeds them; the
    stages pass activations [batch, slice, hidden], the twin's layout, each slice rotated
    by its global positions; the last stage adds the norm and the head. Call `reset()`
    before each sequence."""

    def __init__(self, twin: Decoder, first: int, last: int, embed: bool, head: bool) -> None:
        super().__init__()
        self.first, self.last = embed, head
        self.head_dim, self.rope_base = twin.config.head_dim, twin.config.rope_base
        if embed:
            self.embed = copy.deepcopy(twin.embed)
        if head:
            self.norm = copy.deepcopy(twin.norm)
            # a copy of its own: tied to the embedding, the pipeline's two ends each hold one
            self.head_weight = copy.deepcopy(twin.head.weight)
        self.blocks = nn.ModuleList(copy.deepcopy(twin.blocks[i]) for i in range(first, last))
        self.reset()

    def reset(self) -> None:
        """Forget the cached slices: the next call is the first slice of a new sequence."""
        self.seen = 0
        self.kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per slice, per block
        self.cached: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # the same, as leaves
        self.cache_grads: list[list[list[torch.Tensor | None]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x.t())  # ids [slice, batch] -> [batch, slice, hidden]
        start, s = self.seen, x.shape[1]
        # global positions: slice j's tokens start at `seen`, not at 0
        cos, sin = rope_tables(self.head_dim, torch.arange(start, start + s, device=x.device),
                               self.rope_base, x.dtype)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, block in enumerate(self.blocks):
            def with_cache(k: torch.Tensor, v: torch.Tensor, i: int = i
                           ) -> tuple[torch.Tensor, torch.Tensor]:
                # this slice's rotated keys and values [batch, kv_heads, s, d] after the
                # earlier slices': those are detached leaves, whose gradient is collected here
                # and handed to their own slice's backward later (take_gradients)
                kept.append((k, v))
                return (torch.cat([c[i][0] for c in self.cached] + [k], dim=2),
                        torch.cat([c[i][1] for c in self.cached] + [v], dim=2))

            attn, h = block.attn, block.attn_norm(x)
            # the twin's attention with a cache: the slice's queries are the last of the keys,
            # so they see every earlier slice and, causally, their own
            out = grouped_query_attention(attn.q_proj(h), attn.k_proj(h), attn.v_proj(h),
                                          cos, sin, attn.head_dim, keep=with_cache)
            x = x + attn.o_proj(out)
            x = x + block.mlp(block.mlp_norm(x))
        self.kept.append(kept)
        # detach + requires_grad_: a new leaf over the same values, cutting later slices' graphs
        # from this one, so each slice's backward runs on its own (TeraPipe's order, last first)
        self.cached.append([(k.detach().requires_grad_(), v.detach().requires_grad_())
                            for k, v in kept])
        self.cache_grads.append([[None, None] for _ in self.blocks])
        self.seen += s
        return nn.functional.linear(self.norm(x), self.head_weight) if self.last else x

    def carried_state(self, slice_: int) -> tuple[list, list, list]:
        """For the pipeline engine's backward of slice `slice_`: its keys and values (extra
        roots) with the gradient later slices sent them, and the cached leaves of earlier
        slices that its attention read (extra inputs, whose gradients `take_gradients`
        keeps for those slices' own backward)."""
        roots, grads = [], []
        for (k, v), (dk, dv) in zip(self.kept[slice_], self.cache_grads[slice_], strict=True):
            roots += [k, v]
            grads += [torch.zeros_like(k) if dk is None else dk,
                      torch.zeros_like(v) if dv is None else dv]
        leaves = [t for earlier in self.cached[:slice_] for kv in earlier for t in kv]
        return roots, grads, leaves

    def take_gradients(self, slice_: int, grads: list[torch.Tensor | None]) -> None:
        """Add slice `slice_`'s share of the earlier slices' key/value gradients."""
        it = iter(grads)
        for earlier in range(slice_):
            for i in range(len(self.blocks)):
                for j in (0, 1):
                    g = next(it)
                    if g is not None:
                        held = self.cache_grads[earlier][i][j]
                        self.cache_grads[earlier][i][j] = g if held is None else held + g


def token_stages(twin: Decoder, stages: int) -> list[TokenStage]:
    """The twin's blocks shared evenly over `stages` TokenStages (embedding on the first,
    norm and head on the last)."""
    n = len(twin.blocks)
    if not 1 <= stages <= n:
        raise ValueError(f"stages must be between 1 and the twin's {n} blocks; got {stages}")
    # integer cuts: stage block counts differ by at most one
    cuts = [n * s // stages for s in range(stages + 1)]
    return [TokenStage(twin, cuts[s], cuts[s + 1], s == 0, s == stages - 1)
            for s in range(stages)]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a slice's logits [batch, slice, vocab] against its targets
    [slice, batch] (cut along the sequence, as the ids were)."""
    return cross_entropy(logits, targets.t())


def slice_cost(start: int, length: int, per_token: float, per_pair: float,
               per_slice: float = 0.0) -> float:
    """One stage's time for tokens start..start+length-1: a fixed cost per slice (kernel
    launches, a message, a device less busy on a small slice), per-token work
    (projections, MLP) and attention, one unit per (query, visible key) pair."""
    # each query sees all `start` earlier tokens, plus a causal triangle within the slice
    pairs = length * start + length * (length + 1) / 2
    return per_slice + per_token * length + per_pair * pairs


def pipeline_latency(sizes: list[int], stages: int, per_token: float, per_pair: float,
                     per_slice: float = 0.0) -> float:
    """TeraPipe's latency model of one sequence's forward: every slice through the first
    stage, then the slowest slice through the other stages - 1. Without a per-slice
    cost the sum is the same for any slicing, and the finest slicing wins; with one,
    more slices cost more and the choice is a real trade."""
    costs, start = [], 0
    for n in sizes:
        costs.append(slice_cost(start, n, per_token, per_pair, per_slice))
        start += n
    # TeraPipe's (Li et al. 2021) latency: every slice through one stage, plus the slowest
    # slice through the remaining stages - 1
    return sum(costs) + (stages - 1) * max(costs)


def best_slices(seq_len: int, stages: int, per_token: float, per_pair: float,
                unit: int = 1, per_slice: float = 0.0) -> list[int]:
    """Slice lengths (multiples of `unit`) minimising `pipeline_latency`: for each
    candidate longest-slice time t_max, the cheapest cover of the sequence by slices no
    slower than t_max (dynamic programming over slice ends); the best t_max wins."""
    if seq_len % unit or seq_len < 1 or unit < 1:
        raise ValueError(f"seq_len ({seq_len}) must be a positive multiple of unit ({unit})")
    n = seq_len // unit
    if n > 128:  # the search is about n^4 steps of Python
        raise ValueError(f"seq_len / unit = {n} slice units is too fine for this search; "
                         f"pass unit >= {-(-seq_len // 128)}")
    cost = {(b, e): slice_cost(b * unit, (e - b) * unit, per_token, per_pair, per_slice)
            for b in range(n) for e in range(b + 1, n + 1)}
    best_total, best_sizes = math.inf, [seq_len]
    for t_max in sorted(set(cost.values())):
        if (stages - 1) * t_max >= best_total:
            break  # a larger t_max only adds to the latency from here on
        total = [0.0] + [math.inf] * n
        back = [0] * (n + 1)
        for e in range(1, n + 1):
            for b in range(e):
                c = cost[(b, e)]
                if c <= t_max and total[b] + c < total[e]:
                    total[e], back[e] = total[b] + c, b
        if total[n] + (stages - 1) * t_max < best_total:
            sizes, e = [], n
            while e:
                sizes.append((e - back[e]) * unit)
                e = back[e]
            best_total, best_sizes = total[n] + (stages - 1) * t_max, sizes[::-1]
    return best_sizes


def check_terapipe_against_twin(sizes: list[int], batch: int = 2, seed: int = 7) -> dict:
    """Run on every rank of a launched pipeline (one stage per rank): one TeraPipe step of a
    float64 decoder on a sequence cut into slices of `sizes`, beside the one-process twin.
    Returns the loss (last stage), this rank's parameter gradients by the twin's names
    (the tied head's copy as "head_weight"), and the twin's."""
    from ..pipeline import Pipeline, schedule
    from ..runtime import rank, world_size

    seq_len = sum(sizes)
    config = DecoderConfig(vocab_size=32, layers=2 * world_size(), hidden=16, heads=4,
                           kv_heads=2, seq_len=seq_len)
    twin = decoder(config, seed, torch.float64)
    stages = token_stages(twin, world_size())  # copies: the twin stays the reference
    pipe = Pipeline(stages, schedule("terapipe", world_size(), len(sizes)))
    gen = torch.Generator().manual_seed(seed)
    # a CPU generator draws on the host: moved just below
    ids, targets = (torch.randint(0, 32, (seq_len, batch), generator=gen) for _ in range(2))
    ids, targets = ids.to(device()), targets.to(device())
    stage = stages[rank()]
    stage.reset()
    loss = pipe.train_step(ids, targets, token_loss, sizes)
    reference = token_loss(twin(ids.t()), targets)
    reference.backward()
    first = len(twin.blocks) * rank() // world_size()
    mine = {}
    for name, p in stage.named_parameters():
        if name.startswith("blocks."):
            index, rest = name[len("blocks."):].split(".", 1)
            name = f"blocks.{first + int(index)}.{rest}"
        mine[name] = p.grad
    return {"loss": loss, "reference_loss": reference.item(), "grads": mine,
            "twin_grads": {n: p.grad for n, p in twin.named_parameters()}}
