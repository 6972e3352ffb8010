"""Dropless routing (MegaBlocks, Gale et al. 2022): no capacity, so no token is dropped.

The chosen (token, expert) pairs are sorted by expert and each expert runs once on its
contiguous group, however large: a grouped matmul instead of a padded
[E, capacity, hidden] buffer. MegaBlocks pads each group to a multiple of its block size
(128 rows): negligible for groups much larger than a block, costly otherwise.
"""

from __future__ import annotations

import math

import torch

from .layer import MoELayer
from .top_k import TopKCapacity


class Dropless(TopKCapacity):
    """Top-k with capacity = every token: the usual gate weights, every choice kept."""

    capacity_buffer = False  # groups of any size: the experts run on the rows that arrived

    def __init__(self, k: int, order: str = "softmax_topk") -> None:
        super().__init__(k, capacity_factor=1.0, min_capacity=1, order=order)

    def __repr__(self) -> str:
        return f"Dropless(k={self.k}, order={self.order!r})"

    def factor(self, num_experts: int) -> float:
        # C = ceil(k T / E x E / k) = T: an expert can be chosen by every token, never more
        return num_experts / self.k


class DroplessMoE(MoELayer):
    """MoELayer's gate and experts with every choice kept (the `Dropless` rule).
    `last_groups` holds the tokens each expert processed in the last call."""

    @classmethod
    def make_rule(cls, k: int, capacity_factor: float, min_capacity: int,
                  order: str) -> Dropless:
        return Dropless(k, order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        num_experts = logits.shape[1]
        choices = self.rule.choose(logits)
        self.last_routing = choices.routing
        order = torch.argsort(choices.expert, stable=True)  # group the choices by expert
        token, expert, weight = choices.token[order], choices.expert[order], \
            choices.weight[order]
        groups = torch.bincount(expert, minlength=num_experts).tolist()
        self.last_groups = groups
        # a grouped matmul: each expert once, on its contiguous group of rows
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
