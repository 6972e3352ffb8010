"""Expert-choice routing (Zhou et al. 2022): the experts choose.

Each expert takes the C tokens with the highest router probability for it, so every
expert does exactly C tokens' work (perfect balance by construction), while a token may
be picked by several experts or by none. Choosing over the whole batch looks at later
tokens, so as is it cannot decode autoregressively (the paper's caveat).
"""

from __future__ import annotations

import math

import torch

from .. import collectives
from ..runtime import rank, world_size
from .layer import MoELayer
from .rule import Choices, RoutingRule


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """C = k T / E x factor tokens per expert (at least 1, at most every token): k T / E
    is what k choices per token would give each expert on average."""
    return min(tokens, max(1, math.ceil(k * tokens / num_experts * capacity_factor)))


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
    cap = expert_capacity(total, num_experts, k, capacity_factor)
    # picking is discrete: the scores travel detached, the weights keep their gradient
    # (probs[token, expert] on the token's own rank)
    columns = probs.detach().reshape(tokens, size, per_rank).transpose(0, 1)  # [owner, T, L]
    scores = collectives.all_to_all(columns.reshape(size * tokens, per_rank),
                                    [tokens] * size, everyone.tolist(), group)  # [total, L]
    picks = scores.t().topk(cap, dim=-1).indices  # [L, C]: global token ids, as topk picks
    # them on one process (the same scores in the same order: ties break alike)
    ends = everyone.cumsum(0)
    starts = ends - everyone
    source = torch.searchsorted(ends, picks.reshape(-1), right=True)
    expert = (me * per_rank + torch.arange(per_rank, device=probs.device)).repeat_interleave(cap)
    pairs = torch.stack([picks.reshape(-1) - starts[source], expert], dim=1)
    order = torch.argsort(source, stable=True)
    counts = torch.bincount(source, minlength=size).tolist()
    mine = collectives.all_to_all(pairs[order], counts, None, group)
    return mine[:, 0], mine[:, 1]


class ExpertChoice(RoutingRule):
    """Each expert picks its top C tokens by router probability (softmax over experts);
    a pick's weight is that probability."""

    def __init__(self, k: int, capacity_factor: float = 1.25) -> None:
        self.k, self.capacity_factor = k, capacity_factor

    def __repr__(self) -> str:
        return f"ExpertChoice(k={self.k}, capacity_factor={self.capacity_factor})"

    def picks(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [E, C], token [E, C]): each expert's top C tokens of probs [T, E]."""
        tokens, num_experts = probs.shape
        cap = expert_capacity(tokens, num_experts, self.k, self.capacity_factor)
        return probs.t().topk(cap, dim=-1)

    def choose(self, logits: torch.Tensor) -> Choices:
        weight, picks = self.picks(logits.softmax(-1))
        expert = torch.arange(picks.shape[0], device=picks.device)
        expert = expert.repeat_interleave(picks.shape[1])
        return Choices(picks.reshape(-1), expert, torch.zeros_like(expert), weight.reshape(-1))

    def choose_global(self, logits: torch.Tensor, per_rank: int, group=None) -> Choices:
        probs = logits.softmax(-1)
        token, expert = global_expert_choice(probs, self.k, self.capacity_factor, per_rank,
                                             group)
        return Choices(token, expert, torch.zeros_like(token), probs[token, expert])


class ExpertChoiceMoE(MoELayer):
    """The gate's probabilities, but each expert picks its top C = k * T / E *
    capacity_factor tokens (the `ExpertChoice` rule); a token's output sums the experts
    that picked it, weighted by its probability for each. `last_picks` [E, C] holds the
    chosen token indices."""

    @classmethod
    def make_rule(cls, k: int, capacity_factor: float, min_capacity: int,
                  order: str) -> ExpertChoice:
        return ExpertChoice(k, capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)  # [T, E]
        weight, picks = self.rule.picks(probs)  # [E, C]: each expert's top tokens
        self.last_picks, self.last_tokens = picks, probs.shape[0]
        out = torch.stack([e(x[picks[i]]) for i, e in enumerate(self.experts)])  # [E, C, h]
        y = x.new_zeros(x.shape).index_add(0, picks.reshape(-1),
                                           (out * weight.unsqueeze(-1)).reshape(-1, x.shape[1]))
        return y + self.shared(x) if self.shared is not None else y

    def experts_per_token(self) -> torch.Tensor:
        """How many experts picked each token in the last call (0 = skipped entirely)."""
        return torch.bincount(self.last_picks.reshape(-1), minlength=self.last_tokens)
