"""The routing rule, an extension point: which experts each token's rows go to, and with
what weight. One rule object serves both the one-process twin (`choose`, on the whole
batch) and `ExpertParallelMoE` (`choose_global`, on this rank's tokens as if every rank's
were one batch), so the parallel layer equals one process by construction.

The rules: top-k with capacity (top_k.py: Switch / GShard), dropless (dropless.py:
MegaBlocks), expert choice (expert_choice.py) and LSH centroids (lsh.py: LSH-MoE, which
also changes what travels: `pack` and `unpack`). A new rule is one file with a subclass
of `RoutingRule` (and, if it computes differently on one process, a twin subclassing
`MoELayer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .routing import Routing


@dataclass
class Choices:
    """The kept (token, expert) choices, one per entry: token [N], expert [N], slot [N]
    (the row in the expert's capacity buffer; 0 for rules without one), weight [N], and
    the token-choice `Routing` they came from (None for expert choice)."""

    token: torch.Tensor
    expert: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    routing: Routing | None = None

    @classmethod
    def kept(cls, routing: Routing) -> Choices:
        """The kept choices of a token-choice Routing, token by token (token-major)."""
        kept = routing.kept
        token = torch.arange(routing.expert.shape[0], device=routing.expert.device)
        token = token.unsqueeze(1).expand_as(routing.expert)[kept]
        return cls(token, routing.expert[kept], routing.slot[kept], routing.weight[kept],
                   routing)


class RoutingRule:
    """Which expert each token goes to. Subclasses give `choose` (one process) and
    `choose_global` (one rank of a group, equal to its share of `choose` on the whole
    batch); `pack` / `unpack` change what travels (default: each choice's token row)."""

    # True when `slot` indexes an [E, capacity, hidden] buffer that every kept choice fits
    # (top-k with capacity); other rules run the experts on the rows that arrived.
    capacity_buffer: bool = False

    def choose(self, logits: torch.Tensor) -> Choices:
        """The kept choices of all T tokens (rows of logits [T, E]) on one process."""
        raise NotImplementedError

    def choose_global(self, logits: torch.Tensor, per_rank: int, group=None) -> Choices:
        """This rank's kept choices as `choose` makes them on the concatenated batch of
        every rank of `group` (rank 0's tokens first); expert e lives on rank
        e // per_rank."""
        raise NotImplementedError

    def pack(self, x: torch.Tensor, choices: Choices
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        """The rows that travel to the experts: (rows, their expert, their slot, what
        `unpack` needs). Default: one row per kept choice, its token's."""
        return x[choices.token], choices.expert, choices.slot, None

    def unpack(self, out: torch.Tensor, state: object) -> torch.Tensor:
        """The experts' outputs for the packed rows -> one output per kept choice."""
        return out
