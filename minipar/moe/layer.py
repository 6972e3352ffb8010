"""The MoE layer on one process: a gate, E expert FFNs (and an optional shared expert),
tokens dispatched into an [E, capacity, hidden] buffer by index and combined back by
their gate weights; and a short training loop that reports the router's balance."""

from __future__ import annotations

import torch
from torch import nn

from ..models import FFN
from .routing import Gate, Routing, _check, imbalance
from .rule import RoutingRule
from .top_k import TopKCapacity


class MoELayer(nn.Module):
    """Gate + E expert FFNs (+ an optional shared expert every token also visits).

    Dispatch and combine are index operations: tokens are scattered into an
    [E, capacity, hidden] buffer, each expert runs on its rows, and the outputs are
    gathered back and weighted; no Python loop over tokens. `rule` is the routing rule
    (top-k with capacity here; `make_rule` is what the other twins change), the same
    object ExpertParallelMoE routes with. `last_routing` keeps the latest Routing for
    statistics and the auxiliary losses.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2,
                 capacity_factor: float = 1.25, min_capacity: int = 1,
                 order: str = "softmax_topk", noisy: bool = False, shared_expert: bool = False,
                 seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        _check(k, num_experts, capacity_factor, order)
        torch.manual_seed(seed)
        self.rule = self.make_rule(k, capacity_factor, min_capacity, order)
        self.gate = Gate(hidden, num_experts, noisy, dtype)
        self.experts = nn.ModuleList(FFN(hidden, ffn, dtype) for _ in range(num_experts))
        self.shared = FFN(hidden, ffn, dtype) if shared_expert else None
        self.last_routing: Routing | None = None

    @classmethod
    def make_rule(cls, k: int, capacity_factor: float, min_capacity: int,
                  order: str) -> RoutingRule:
        """The routing rule this twin's arguments describe: top-k with capacity."""
        return TopKCapacity(k, capacity_factor, min_capacity, order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.gate.router.in_features:
            raise ValueError(f"x must be [tokens, {self.gate.router.in_features}]; got "
                             f"{tuple(x.shape)}")
        routing = self.rule.route(self.gate(x))
        self.last_routing = routing
        out = dispatch_combine(x, routing, list(self.experts))
        return out + self.shared(x) if self.shared is not None else out


def dispatch(x: torch.Tensor, routing: Routing, num_experts: int) -> torch.Tensor:
    """Scatter tokens into an [E, capacity, hidden] buffer (empty slots stay zero)."""
    buffer = x.new_zeros(num_experts, routing.capacity, x.shape[1])
    token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(routing.expert)
    kept = routing.kept
    buffer[routing.expert[kept], routing.slot[kept]] = x[token[kept]]
    return buffer


def combine(expert_out: torch.Tensor, routing: Routing, tokens: int) -> torch.Tensor:
    """Gather each kept choice's expert output back to its token, weighted by the gate."""
    kept = routing.kept
    token = torch.arange(tokens, device=expert_out.device).unsqueeze(1).expand_as(routing.expert)
    picked = expert_out[routing.expert[kept], routing.slot[kept]]
    out = expert_out.new_zeros(tokens, expert_out.shape[-1])
    return out.index_add(0, token[kept], picked * routing.weight[kept].unsqueeze(-1))


def dispatch_combine(x: torch.Tensor, routing: Routing, experts: list[nn.Module]) -> torch.Tensor:
    """Dispatch, each expert on its [capacity, hidden] rows (empty slots included), combine."""
    buffer = dispatch(x, routing, len(experts))
    expert_out = torch.stack([expert(buffer[i]) for i, expert in enumerate(experts)])
    return combine(expert_out, routing, x.shape[0])


def train_router_stats(layer: MoELayer, x: torch.Tensor, target: torch.Tensor, steps: int,
                       lr: float = 0.05, balance_weight: float = 0.01,
                       z_weight: float = 0.0) -> list[dict]:
    """Train `layer` to map x to target with SGD plus the auxiliary losses; per step report
    each expert's load, the drop rate, the balance and z losses and the imbalance."""
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        out = layer(x)
        r = layer.last_routing
        loss = nn.functional.mse_loss(out, target) + balance_weight * r.balance_loss \
            + z_weight * r.z_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        load = r.load(len(layer.experts))
        history.append({"load": load.tolist(), "drop_rate": r.drop_rate,
                        "balance_loss": r.balance_loss.item(), "z_loss": r.z_loss.item(),
                        "imbalance": imbalance(load), "loss": loss.item()})
    return history
