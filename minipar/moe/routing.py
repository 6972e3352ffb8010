"""Mixture-of-Experts: route each token to a few experts, keep them balanced.

y = sum over chosen experts i of G_i(x) E_i(x), with the gate computed from router
logits H(x) = x W_g (plus learned noise for the noisy gate).

Conventions (one set for the package; frameworks differ, so they are stated here):
- Gate orders: "softmax_topk" takes the softmax over all experts, then keeps the top k
  probabilities as they are (no renormalization, as Switch does; pass renormalize=True
  for GShard-style weights that sum to 1); "topk_softmax" keeps the top k logits and
  takes the softmax over those only (the 2017 sparsely-gated MoE, Mixtral), so the
  weights sum to 1. The Switch gate is "softmax_topk" with k = 1; the noisy gate adds
  N(0, 1) x softplus(x W_noise) to the logits (training only) before "topk_softmax".
- Capacity per expert: C = max(ceil(k * T / E * capacity_factor), min_capacity).
- Which tokens drop: slots are given in priority order, first every token's first
  choice in token order, then every token's second choice, and so on; a choice that
  finds its expert full is dropped (its weight is lost, not moved elsewhere).
- Load-balancing loss (Switch / GShard form): E * sum_i f_i * P_i, where P_i is the
  mean router probability of expert i (softmax over all experts) and f_i is the share
  of all k * T choices made for expert i, counted before capacity drops. Under uniform
  routing it equals 1.
- Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

GATE_ORDERS = ("softmax_topk", "topk_softmax")


@dataclass
class Routing:
    """Where each token's k choices go: expert [T, k], slot [T, k] (-1 = dropped),
    weight [T, k] (0 where dropped), the capacity, and the router's losses."""

    expert: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    capacity: int
    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    probs: torch.Tensor

    @property
    def kept(self) -> torch.Tensor:
        return self.slot >= 0

    @property
    def drop_rate(self) -> float:
        return 1.0 - self.kept.float().mean().item()

    def load(self, num_experts: int) -> torch.Tensor:
        """Tokens each expert processes (after drops)."""
        return torch.bincount(self.expert[self.kept], minlength=num_experts)

    def routed(self, num_experts: int) -> torch.Tensor:
        """Token choices routed to each expert before capacity drops any: the demand that
        sets the capacity needed to drop nothing (`imbalance` of it)."""
        return torch.bincount(self.expert.flatten(), minlength=num_experts)


def capacity(tokens: int, num_experts: int, k: int, capacity_factor: float,
             min_capacity: int = 1) -> int:
    """C = max(ceil(k * T / E * capacity_factor), min_capacity)."""
    return max(math.ceil(k * tokens / num_experts * capacity_factor), min_capacity)


def _check(k: int, num_experts: int, capacity_factor: float, order: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an int from 1 to the number of experts ({num_experts}); "
                         f"got {k!r}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0; got {capacity_factor!r}")
    if order not in GATE_ORDERS:
        raise ValueError(f"order must be one of {GATE_ORDERS}; got {order!r}")


def route(logits: torch.Tensor, k: int, capacity_factor: float = 1.25, min_capacity: int = 1,
          order: str = "softmax_topk", renormalize: bool = False,
          select_bias: torch.Tensor | None = None) -> Routing:
    """Assign each of T tokens (rows of logits [T, E]) to k experts with capacity limits.
    `select_bias` [E] is added to the logits for choosing the k experts only: the gate
    weights come from the unbiased logits (DeepSeek-V3's auxiliary-loss-free balance)."""
    tokens, num_experts = logits.shape
    _check(k, num_experts, capacity_factor, order)
    probs = logits.softmax(-1)
    if select_bias is None:
        top_logits, expert = logits.topk(k, dim=-1)
    else:
        expert = (logits + select_bias).topk(k, dim=-1).indices
        top_logits = logits.gather(1, expert)
    if order == "topk_softmax":
        weight = top_logits.softmax(-1)
    else:
        weight = probs.gather(1, expert)
        if renormalize:
            weight = weight / weight.sum(-1, keepdim=True)
    cap = capacity(tokens, num_experts, k, capacity_factor, min_capacity)
    # slots in priority order: choice 0 of every token (token order), then choice 1, ...
    one_hot = nn.functional.one_hot(expert.t().reshape(-1), num_experts)  # [k*T, E]
    position = (one_hot.cumsum(0) - 1).gather(1, expert.t().reshape(-1, 1)).view(k, tokens).t()
    slot = torch.where(position < cap, position, torch.full_like(position, -1))
    weight = torch.where(slot >= 0, weight, torch.zeros_like(weight))
    chosen_share = one_hot.float().mean(0)  # f_i over all k*T choices, before drops
    balance = num_experts * (chosen_share * probs.mean(0)).sum()
    z_loss = torch.logsumexp(logits, -1).pow(2).mean()
    return Routing(expert, slot, weight, cap, balance, z_loss, probs)


class Gate(nn.Module):
    """Router: logits = x W_g; "noisy" adds N(0,1) * softplus(x W_noise) while training."""

    def __init__(self, hidden: int, num_experts: int, noisy: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.noise = nn.Linear(hidden, num_experts, bias=False, dtype=dtype) if noisy else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.noise is not None and self.training:
            logits = logits + torch.randn_like(logits) * nn.functional.softplus(self.noise(x))
        return logits


def imbalance(load: torch.Tensor) -> float:
    """Busiest expert's load over the mean load (1 = perfectly balanced, E = all on one)."""
    load = load.float()
    return float(load.max() / load.mean()) if load.sum() > 0 else 1.0
