"""Two other ways to route, on the same gate and experts as MoELayer.

- **Dropless** (MegaBlocks, Gale et al. 2022): no capacity, so no token is dropped.
  The chosen (token, expert) pairs are sorted by expert and each expert runs once on
  its contiguous group, however large: a grouped matmul instead of a padded
  [E, capacity, hidden] buffer. MegaBlocks pads each group to a multiple of its block
  size (128 rows): negligible for groups much larger than a block, costly otherwise.
- **Expert choice** (Zhou et al. 2022): the experts choose. Each expert takes the C
  tokens with the highest router probability for it, so every expert does exactly C
  tokens' work (perfect balance by construction), while a token may be picked by
  several experts or by none. Choosing over the whole batch looks at later tokens, so
  as is it cannot decode autoregressively (the paper's caveat).
"""

from __future__ import annotations

import math

import torch

from .. import collectives
from ..runtime import rank, world_size
from .layer import MoELayer
from .routing import route


class DroplessMoE(MoELayer):
    """MoELayer's gate and experts with every choice kept. `last_groups` holds the tokens
    each expert processed in the last call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        num_experts = logits.shape[1]
        # capacity = all tokens: route() then keeps every choice, with the usual weights
        routing = route(logits, self.k, num_experts / self.k, 1, self.order)
        self.last_routing = routing
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.k)
        expert, weight = routing.expert.reshape(-1), routing.weight.reshape(-1)
        order = torch.argsort(expert, stable=True)  # group the choices by expert
        token, expert, weight = token[order], expert[order], weight[order]
        groups = torch.bincount(expert, minlength=num_experts).tolist()
        self.last_groups = groups
        outputs = [e(rows) for e, rows in zip(self.experts, torch.split(x[token], groups),
                                              strict=True)]
        out = torch.cat(outputs) * weight.unsqueeze(-1)
        y = x.new_zeros(x.shape).index_add(0, token, out)
        return y + self.shared(x) if self.shared is not None else y


def padding_waste(groups: list[int], capacity: int | None = None, block: int = 1) -> dict:
    """Expert rows computed but empty, and choices dropped: with a capacity every expert
    computes `capacity` rows (empty slots wasted, overflow dropped); dropless pads each
    group up to a multiple of `block` (1: grouped matmul, no padding)."""
    used = sum(min(g, capacity) if capacity else g for g in groups)
    computed = capacity * len(groups) if capacity else sum(math.ceil(g / block) * block
                                                           for g in groups)
    dropped = sum(max(g - capacity, 0) for g in groups) if capacity else 0
    return {"computed_rows": computed, "used_rows": used,
            "waste": 1 - used / computed if computed else 0.0, "dropped": dropped}


class ExpertChoiceMoE(MoELayer):
    """The gate's probabilities, but each expert picks its top C = k * T / E *
    capacity_factor tokens; a token's output sums the experts that picked it, weighted by
    its probability for each. `last_picks` [E, C] holds the chosen token indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)  # [T, E]
        tokens, num_experts = probs.shape
        cap = min(tokens, max(1, math.ceil(self.k * tokens / num_experts * self.capacity_factor)))
        weight, picks = probs.t().topk(cap, dim=-1)  # [E, C]: each expert's top tokens
        self.last_picks, self.last_tokens = picks, tokens
        out = torch.stack([e(x[picks[i]]) for i, e in enumerate(self.experts)])  # [E, C, h]
        y = x.new_zeros(x.shape).index_add(0, picks.reshape(-1),
                                           (out * weight.unsqueeze(-1)).reshape(-1, x.shape[1]))
        return y + self.shared(x) if self.shared is not None else y

    def experts_per_token(self) -> torch.Tensor:
        """How many experts picked each token in the last call (0 = skipped entirely)."""
        return torch.bincount(self.last_picks.reshape(-1), minlength=self.last_tokens)


def global_expert_choice(probs: torch.Tensor, k: int, capacity_factor: float, per_rank: int,
                         group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice over the tokens of every rank of `group` (rank 0's first), as
    ExpertChoiceMoE picks on the concatenated batch. Expert e lives on rank e // per_rank:
    each rank sends every owner its experts' probability columns, the owner takes each
    expert's top C tokens of the whole batch and tells every rank which of its tokens
    were picked. Returns this rank's picked (token, expert) pairs, grouped by owner."""
    size, me = world_size(group), rank(group)
    tokens, num_experts = probs.shape
    everyone = collectives.all_gather(torch.tensor([tokens], device=probs.device), group)
    total = int(everyone.sum())
    cap = min(total, max(1, math.ceil(k * total / num_experts * capacity_factor)))
    columns = probs.detach().reshape(tokens, size, per_rank).transpose(0, 1)  # [owner, T, L]
    scores = collectives.all_to_all(columns.reshape(size * tokens, per_rank),
                                    [tokens] * size, everyone.tolist(), group)  # [total, L]
    picks = scores.t().topk(cap, dim=-1).indices  # [L, C]: global token ids
    ends = everyone.cumsum(0)
    starts = ends - everyone
    source = torch.searchsorted(ends, picks.reshape(-1), right=True)
    expert = (me * per_rank + torch.arange(per_rank, device=probs.device)).repeat_interleave(cap)
    pairs = torch.stack([picks.reshape(-1) - starts[source], expert], dim=1)
    order = torch.argsort(source, stable=True)
    counts = torch.bincount(source, minlength=size).tolist()
    mine = collectives.all_to_all(pairs[order], counts, None, group)
    return mine[:, 0], mine[:, 1]
