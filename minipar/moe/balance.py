"""Keeping a mixture's experts evenly loaded while it trains.

A router left alone drifts: experts that start slightly ahead get more tokens, learn
faster and get more still, while others starve, and under expert parallelism the
busiest expert sets every step's time. Two remedies, one `LoadBalance` per MoE layer:

- **"aux"**, the auxiliary loss (Switch, Fedus et al. 2021; GShard): add
  coef x E x sum_i f_i P_i to the loss, where f_i is the share of the token choices
  routed to expert i (counted, no gradient) and P_i the mean router probability of
  expert i (which has one). Balanced, it is 1. Both are means over the **global**
  batch: the counts are all-reduced over every rank holding other tokens of the same
  micro-batch (dp and ep), so the composed loss equals one process's. Its gradient
  enters backward through `_AuxGradient` (Megatron-LM's MoEAuxLossAutoScaler): the
  layer's output carries it, so it works inside a pipeline, whose loss lives on
  another rank.
- **"bias"**, DeepSeek-V3's auxiliary-loss-free balance: a bias b_i per expert is added
  to the router's logits for **choosing** the top k only (the gate weights come from
  the unbiased logits), and after each optimizer step b_i += rate x sign(mean load -
  load_i), from the step's loads all-reduced over the same ranks. Nothing is added to
  the loss; an overloaded expert just gets chosen less (DeepSeek-V3: rate 0.001).

Each layer also counts its experts' load per step (`load`), which the trainer logs in
metrics.jsonl, balanced or not.
"""

from __future__ import annotations

import torch

from .. import collectives
from ..decoder import BALANCES
from ..runtime import world_size
from .dropless import Dropless
from .routing import Routing, route
from .top_k import global_routing


class BiasedDropless(Dropless):
    """Dropless top-k whose choice (not its weights) adds `bias` [E] to the logits."""

    def __init__(self, k: int, bias: torch.Tensor, order: str = "softmax_topk") -> None:
        super().__init__(k, order)
        self.bias = bias

    def route(self, logits: torch.Tensor) -> Routing:
        return route(logits, self.k, self.factor(logits.shape[1]), self.min_capacity,
                     self.order, select_bias=self.bias)

    def route_global(self, logits: torch.Tensor, group=None) -> Routing:
        return global_routing(logits, self.k, self.factor(logits.shape[1]), self.min_capacity,
                              self.order, group, select_bias=self.bias)


class _AuxGradient(torch.autograd.Function):
    """Returns `y` unchanged; in backward also hands the auxiliary loss its gradient of 1,
    so its own backward runs beside the activation's."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(aux)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class LoadBalance:
    """One MoE layer's balancing (`kind` in BALANCES) and its load counter.

    `group`: the ranks holding other tokens of the same micro-batch (a group of its own:
    these all-reduces run in forward, beside data parallelism's on other threads).
    `token_weight`: the weight the loss gives each of this rank's tokens in the current
    chunk (the trainer sets it before each forward-backward), so the auxiliary term is
    weighted as the cross-entropy is: a per-token term, summed."""

    def __init__(self, num_experts: int, kind: str, coef: float = 0.01, rate: float = 0.001,
                 group=None, device: torch.device | None = None) -> None:
        if kind not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(BALANCES)}; got {kind!r}")
        self.num_experts, self.kind, self.coef, self.rate = num_experts, kind, coef, rate
        self.group, self.grouped = group, world_size(group) > 1
        self.bias = torch.zeros(num_experts, device=device)
        self.load = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.token_weight = 1.0

    def rule(self, k: int, order: str) -> BiasedDropless:
        """The routing rule that steers the choice by this layer's bias."""
        return BiasedDropless(k, self.bias, order)

    def after_routing(self, routing: Routing, y: torch.Tensor) -> torch.Tensor:
        """Count the choices (when training) and, for "aux", attach the auxiliary loss's
        gradient to the layer's output `y`."""
        if not torch.is_grad_enabled():  # evaluation: no counts, no loss
            return y
        counts = torch.bincount(routing.expert.flatten(), minlength=self.num_experts)
        counts = counts.to(torch.float64)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.load += counts
        if self.kind != "aux":
            return y
        if self.grouped:
            counts = collectives.all_reduce(counts, group=self.group)
        share = (counts / counts.sum()).to(routing.probs.dtype)  # f_i over the global batch
        # sum over this rank's tokens of E sum_i f_i p_ti: its share of E sum_i f_i P_i
        aux = self.num_experts * (routing.probs * share).sum()
        return _AuxGradient.apply(y, aux * (self.coef * self.token_weight))

    def end_step(self, loads: torch.Tensor) -> None:
        """After the optimizer step, with the step's loads over the global batch: "bias"
        moves each expert's bias toward balance; the counter restarts."""
        if self.kind == "bias":
            self.bias += self.rate * torch.sign(loads.mean() - loads).to(self.bias)
        self.load.zero_()

