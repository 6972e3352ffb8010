"""Tutel's adaptive parallelism (Hwang et al. 2023): one parameter layout, run several ways.

The experts' weights are stored once, sharded over the K ranks: with E >= K experts each
rank holds E/K whole experts; with E < K each expert is split over s = K/E consecutive
ranks along its FFN hidden dimension (Megatron's column / row split of the two
matrices), rank j holding slice j % s of expert j // s. From that one layout the layer
runs with an *adaptive degree* r, picked per call:

- r = 0, data parallel (ZeRO-3 style): every rank all-gathers every expert and runs its
  own tokens through them. Weights travel, tokens stay.
- r = s, tensor parallel inside the expert: every routed row travels to all s ranks of
  its expert, each applies its hidden slice, and the s partial outputs are added on the
  way back. Tokens travel, weights stay. With E >= K (s = 1) this is plain expert
  parallelism.
- r between (a divisor of s): the s ranks of an expert form r slices, each all-gathered
  from s/r neighbours, and the s/r copies of a slice split the rows between them.

Switching r moves no parameters for good: the stored shards never change, only what one
call sends (weights by all-gather, rows by all-to-all). Which is cheaper depends on how
many rows are routed, so `degree_costs` prices each r with the alpha-beta model for the
current capacity and `time_degrees` measures them; `degree="auto"` takes the model's
pick. The output bias (H numbers an expert) is stored split too and always gathered
among the expert's s ranks; each of the r slices adds 1/r of it (as Tutel does), so
every rank's backward takes part in the bias's reduce-scatter.

Routing is global, as in ExpertParallelMoE, so every r equals the one-process layer on
the concatenated batch; the gate's (and shared expert's) gradient is each rank's share.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..runtime import new_groups, rank, world_size
from ..tensor_parallel.mappings import gather_from_sequence_parallel_region
from ..trace import record
from .layer import MoELayer
from .pipeline_moe import partial_output
from .pipelining import pipelined_experts, run_by_expert, step_seconds
from .top_k import TopKCapacity


def valid_degrees(experts: int, ranks: int) -> tuple[int, ...]:
    """0 (data parallel) and every divisor of s = ranks / experts (1 when experts >= ranks)."""
    if experts % ranks and ranks % experts:
        raise ValueError(f"{experts} experts and {ranks} ranks: one must divide the other "
                         f"(each rank holds whole experts, or each expert spans whole ranks)")
    s = max(ranks // experts, 1)
    return (0, *[r for r in range(1, s + 1) if s % r == 0])


def degree_costs(rows: float, hidden: int, ffn: int, experts: int, ranks: int,
                 alpha: float, beta: float, dtype_bytes: int = 4) -> dict[int, float]:
    """Modelled seconds of one forward + backward's communication at each degree.

    `rows`: routed rows a rank sends. Degree 0 all-gathers all E experts' weights (K-1
    ring steps) and reduce-scatters their gradients back; degree r >= 1 all-gathers
    slices among g = s/r ranks (g-1 steps) the same way, and sends each row to r ranks
    in four all-to-alls (dispatch, combine and their backward) plus two small ones
    (counts and which expert), a (K-1)/K share of the rows leaving the rank. Left out:
    the expert compute (the same FLOPs at every degree), load imbalance, overlap.
    """
    per_expert = (2 * hidden * ffn + ffn) * dtype_bytes
    s = max(ranks // experts, 1)
    remote = (ranks - 1) / ranks
    costs = {}
    for r in valid_degrees(experts, ranks):
        if r == 0:
            gather = (ranks - 1) * alpha + remote * experts * per_expert * beta
            costs[r] = 2 * gather
            continue
        g = s // r
        gather = (g - 1) * (alpha + per_expert / s * beta)
        exchange = (ranks - 1) * alpha + rows * r * remote * hidden * dtype_bytes * beta
        costs[r] = 2 * gather + 4 * exchange + 2 * (ranks - 1) * alpha
    return costs


def _blocks(group, size: int):
    """Groups of `size` consecutive ranks of `group` (every rank creates every group, in
    order); returns this rank's."""
    members = dist.get_process_group_ranks(group) if group is not None else \
        list(range(world_size()))
    return new_groups([members[start:start + size] for start in range(0, len(members), size)])


def _ffn(rows: torch.Tensor, up_w, up_b, down_w, down_b) -> torch.Tensor:
    """models.FFN with its weights given: down(gelu(up(rows)))."""
    return nn.functional.gelu(rows @ up_w.T + up_b) @ down_w.T + down_b


class AdaptiveMoE(nn.Module):
    """The experts of a one-process MoELayer (`twin`) sharded over the ranks of `group`
    once, run at `degree` (0, a divisor of s, or "auto"; see the module docstring)."""

    def __init__(self, twin: MoELayer, group=None, degree: int | str = "auto",
                 alpha: float = 5e-5, beta: float = 1e-9) -> None:
        super().__init__()
        ranks, num_experts = world_size(group), len(twin.experts)
        self.degrees = valid_degrees(num_experts, ranks)
        self.group, self.num_experts, self.alpha, self.beta = group, num_experts, alpha, beta
        self.s = max(ranks // num_experts, 1)
        self.per_rank = max(num_experts // ranks, 1)  # whole experts held (1 when s > 1)
        self.hidden, ffn = twin.gate.router.in_features, twin.experts[0].up.out_features
        if ffn % self.s or self.hidden % self.s:
            raise ValueError(f"ffn={ffn} and hidden={self.hidden} must be divisible by the "
                             f"{self.s} ranks each expert is split over")
        self.ffn = ffn
        self.degree = self._check(degree)
        if not isinstance(twin.rule, TopKCapacity):
            raise ValueError(f"AdaptiveMoE routes by top-k with capacity; got {twin.rule!r}")
        self.rule = twin.rule  # the twin's rule object: global routing, as ExpertParallelMoE
        self.gate = copy.deepcopy(twin.gate)
        self.shared = copy.deepcopy(twin.shared) if twin.shared is not None else None
        for name, tensor in self.twin_slices(twin).items():  # [L, ...] each
            self.register_parameter(name, nn.Parameter(tensor.clone()))
        # every rank creates every group, the same way on all ranks
        self.blocks = {g: _blocks(group, g) for g in range(2, self.s + 1) if self.s % g == 0}
        self.last_routing = None
        self.last_degree = self.degree
        self.last_traffic: dict[str, int] = {}
        self.rows_computed = 0  # expert rows this rank ran in the last call

    def _check(self, degree: int | str) -> int | str:
        if degree != "auto" and degree not in self.degrees:
            raise ValueError(f"degree must be 'auto' or one of {self.degrees} for "
                             f"{self.num_experts} experts on {world_size(self.group)} ranks; "
                             f"got {degree!r}")
        return degree

    @staticmethod
    def _gather(shard: torch.Tensor, experts: int, over: tuple[bool, object]) -> torch.Tensor:
        """With over = (True, group): all-gather shards along dim 0 (reduce-scatter of
        the gradient backward). Then put each expert's consecutive slices together:
        [experts, parts, ...]."""
        gather, group = over
        if gather:
            shard = gather_from_sequence_parallel_region(shard, group, dim=0)
        return shard.reshape(experts, -1, *shard.shape[1:])

    def weights(self, degree: int) -> tuple[torch.Tensor, ...]:
        """(up_w, up_b, down_w, down_b) as degree `degree` computes with them: all experts
        whole for 0, else this rank's experts' slice of ffn / degree hidden units."""
        if degree == 0:
            everyone = (world_size(self.group) > 1, self.group)
            experts, weights, bias = self.num_experts, everyone, everyone
        else:
            g = self.s // degree
            experts, weights, bias = self.per_rank, (g > 1, self.blocks.get(g)), \
                (self.s > 1, self.blocks.get(self.s))
        up_w = self._gather(self.up_w, experts, weights).flatten(1, 2)
        up_b = self._gather(self.up_b, experts, weights).flatten(1)
        down_w = self._gather(self.down_w, experts, weights)  # [E, parts, H, F/s]
        down_w = down_w.transpose(1, 2).flatten(2)
        down_b = self._gather(self.down_b, experts, bias).flatten(1)
        return up_w, up_b, down_w, down_b

    def forward(self, x: torch.Tensor, degree: int | str | None = None) -> torch.Tensor:
        degree = self._check(self.degree if degree is None else degree)
        routing = self.rule.route_global(self.gate(x), self.group)
        self.last_routing = routing
        if degree == "auto":  # the same on every rank: it depends on the global capacity
            rows = self.num_experts * routing.capacity / world_size(self.group)
            costs = degree_costs(rows, self.hidden, self.ffn, self.num_experts,
                                 world_size(self.group), self.alpha, self.beta,
                                 x.element_size())
            degree = min(costs, key=costs.get)
        self.last_degree = degree
        with collectives.meter() as gathered:
            params = self.weights(degree)
        # this rank's experts (all of them at degree 0) as functions of their rows
        experts = [lambda rows, i=i: _ffn(rows, *(p[i] for p in params[:3]),
                                         params[3][i] / max(degree, 1))
                   for i in range(len(params[0]))]
        with collectives.meter() as exchanged:
            if degree == 0:  # every expert is here: each kept choice runs where its token is
                with record("compute", "experts (all gathered)"):
                    y, self.rows_computed = partial_output(
                        x, routing.expert, routing.weight, routing.kept, experts, 0)
            else:
                y = self._exchanged(x, routing, degree, experts)
        self.last_traffic = {"weights": gathered.sent_bytes, "rows": exchanged.sent_bytes}
        return y + self.shared(x) if self.shared is not None else y

    def _exchanged(self, x, routing, degree: int, experts: list) -> torch.Tensor:
        """Degree r >= 1: each kept choice goes to the r slices of its expert (to one of
        the s/r copies of each, by its position among this rank's rows for the expert),
        and the r partial outputs come back and add up at the token. Each slice adds 1/r
        of the output bias."""
        kept = routing.kept
        token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(
            routing.expert)[kept]
        expert, weight = routing.expert[kept], routing.weight[kept]
        size, g = world_size(self.group), self.s // degree
        position = (nn.functional.one_hot(expert, self.num_experts).cumsum(0) - 1).gather(
            1, expert.unsqueeze(1)).squeeze(1)
        first_rank = expert // self.per_rank * self.s  # the expert's slice-0 rank
        dest = (first_rank.unsqueeze(1) + g * torch.arange(degree, device=x.device)
                + (position % g).unsqueeze(1)).flatten()
        order = torch.argsort(dest, stable=True)
        token, weight = token.repeat_interleave(degree)[order], \
            weight.repeat_interleave(degree)[order]
        local = (expert % self.per_rank).repeat_interleave(degree)[order]
        send = torch.bincount(dest, minlength=size).tolist()
        recv = collectives.swap_counts(send, self.group)
        arrived_local = collectives.all_to_all(local, send, recv, self.group)
        self.rows_computed = len(arrived_local)
        returned = pipelined_experts(x[token], arrived_local, send, recv,
                                     lambda rows, which: run_by_expert(experts, rows, which), 1,
                                     self.group)
        return x.new_zeros(x.shape).index_add(0, token, returned * weight.unsqueeze(-1))

    def twin_slices(self, twin: MoELayer, grad: bool = False) -> dict[str, torch.Tensor]:
        """The twin's expert tensors (their gradients with `grad`) that this rank's shards
        hold: up_w [L, F/s, H], up_b [L, F/s], down_w [L, H, F/s], down_b [L, H/s] for
        its L whole experts or its slice of one."""
        me = rank(self.group)
        first, part = me // self.s * self.per_rank, me % self.s
        f, h = slice(part * self.ffn // self.s, (part + 1) * self.ffn // self.s), \
            slice(part * self.hidden // self.s, (part + 1) * self.hidden // self.s)
        experts = [twin.experts[first + i] for i in range(self.per_rank)]

        def take(p: torch.Tensor) -> torch.Tensor:
            return p.grad if grad else p.detach()

        return {"up_w": torch.stack([take(e.up.weight)[f] for e in experts]),
                "up_b": torch.stack([take(e.up.bias)[f] for e in experts]),
                "down_w": torch.stack([take(e.down.weight)[:, f] for e in experts]),
                "down_b": torch.stack([take(e.down.bias)[h] for e in experts])}

def time_degrees(layer: AdaptiveMoE, x: torch.Tensor, repeats: int = 3) -> dict[int, float]:
    """Measured seconds of forward + backward at every degree (the slowest rank's median),
    on every rank alike: `layer.degree = min(times, key=times.get)` then runs the fastest."""
    times = {d: step_seconds(lambda d=d: layer(x, d).pow(2).mean().backward(), repeats,
                             layer.group) for d in layer.degrees}
    layer.zero_grad()
    return times
