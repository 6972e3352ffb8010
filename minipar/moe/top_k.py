"""Top-k routing with capacity (Switch, GShard): each token picks its k best experts, an
expert takes at most C choices, in priority order, and the rest drop. The conventions
(gate orders, the capacity formula, which choices drop, the losses) are `route`'s, in
routing.py; here they become a `RoutingRule`, and `global_routing` keeps them exact when
the tokens are spread over ranks."""

from __future__ import annotations

import torch
from torch import nn

from .. import collectives
from ..runtime import rank, world_size
from .routing import Routing, capacity, route
from .rule import Choices, RoutingRule


def global_routing(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
                   order: str, group=None, select_bias: torch.Tensor | None = None
                   ) -> Routing:
    """This rank's routing, with capacity and slots as if the tokens of all ranks (of
    `group`) were one batch (`select_bias`: as `route`'s)."""
    tokens, num_experts = logits.shape
    # capacity k*T: nothing drops
    local = route(logits, k, float(num_experts), 1, order, select_bias=select_bias)
    counts = torch.zeros(k, num_experts, dtype=torch.int64, device=logits.device)
    for j in range(k):
        counts[j] = torch.bincount(local.expert[:, j], minlength=num_experts)
    everyone = collectives.all_gather(counts.unsqueeze(0), group).view(world_size(group), k,
                                                                         num_experts)
    total_tokens = int(collectives.all_gather(torch.tensor([tokens], device=logits.device),
                                              group).sum())
    # global capacity: the formula on every rank's tokens, so drops match one process
    cap = capacity(total_tokens, num_experts, k, capacity_factor, min_capacity)
    me = rank(group)
    # choices of level j land after: all levels < j of every rank, and level j of ranks < me
    # (routing.py's priority order: all first choices in token order, then second choices)
    per_level = everyone.sum(0)  # [k, E]: all ranks' choices at each level
    before = per_level.cumsum(0) - per_level + everyone[:me].sum(0)
    slot = torch.empty_like(local.expert)
    for j in range(k):
        one_hot = nn.functional.one_hot(local.expert[:, j], num_experts)
        within = (one_hot.cumsum(0) - 1).gather(1, local.expert[:, j:j + 1]).squeeze(1)
        slot[:, j] = within + before[j].gather(0, local.expert[:, j])
    slot = torch.where(slot < cap, slot, torch.full_like(slot, -1))
    weight = torch.where(slot >= 0, local.weight, torch.zeros_like(local.weight))  # lost
    return Routing(local.expert, slot, weight, cap, local.balance_loss, local.z_loss,
                   local.probs)


class TopKCapacity(RoutingRule):
    """Token choice: k experts per token, at most C = max(ceil(k T / E x factor),
    min_capacity) choices per expert (routing.py's conventions)."""

    capacity_buffer = True

    def __init__(self, k: int, capacity_factor: float = 1.25, min_capacity: int = 1,
                 order: str = "softmax_topk") -> None:
        self.k, self.capacity_factor, self.min_capacity, self.order = k, capacity_factor, \
            min_capacity, order

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(k={self.k}, capacity_factor={self.capacity_factor}, "
                f"min_capacity={self.min_capacity}, order={self.order!r})")

    def factor(self, num_experts: int) -> float:
        """The capacity factor used for `num_experts` experts."""
        return self.capacity_factor

    def route(self, logits: torch.Tensor) -> Routing:
        """`route` on one process: the whole batch's Routing."""
        factor = self.factor(logits.shape[1])
        return route(logits, self.k, factor, self.min_capacity, self.order)

    def route_global(self, logits: torch.Tensor, group=None) -> Routing:
        """This rank's Routing, capacity and slots counted over every rank of `group`."""
        factor = self.factor(logits.shape[1])
        return global_routing(logits, self.k, factor, self.min_capacity, self.order, group)

    def choose(self, logits: torch.Tensor) -> Choices:
        return Choices.kept(self.route(logits))

    def choose_global(self, logits: torch.Tensor, per_rank: int, group=None) -> Choices:
        return Choices.kept(self.route_global(logits, group))
