"""Pipeline MoE (PPMoE, Chen et al. 2023): experts inside a tensor-parallel group.

In Megatron-style tensor parallelism every rank of the group already holds the same
tokens (the attention block ends in an all-reduce). So split the experts over the group
instead of over data-parallel ranks: each rank routes the tokens with the replicated
gate (the same choices everywhere), runs its own experts on the rows routed to them
(dispatch is an index slice, no communication), and one all-reduce sums the partial
outputs (combine). Two all-to-alls become one all-reduce, over the fast links of a
node.

Gradients: the input enters through f (identity forward, all-reduce backward) and the
output leaves through g (all-reduce forward, identity backward), as in lesson 04. Unlike
lesson 04's replicated layer norms, the gate and the shared expert feed the *partial*
output before g's all-reduce, so each rank's gradient holds only its share (its experts'
weights; the shared expert is added by the group's rank 0 only): sum them over the
group. The same goes for auxiliary losses: the router's balance and z losses come out
identical on every rank, so add them on one rank only (or divide by the group size), or
their gradient counts K times.

The name is the paper's: PPMoE pairs this tensor-parallel placement of the experts with
pipeline parallelism for the rest of the model; nothing here pipelines. Under Megatron's
sequence parallelism the tokens arrive split along the sequence, and need an all-gather
first.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..runtime import rank
from ..tensor_parallel.mappings import copy_to_parallel_region, reduce_from_parallel_region
from ..trace import record
from .expert_parallel import experts_per_rank
from .layer import MoELayer
from .top_k import TopKCapacity


def partial_output(x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                   kept: torch.Tensor, experts: nn.ModuleList, first: int
                   ) -> tuple[torch.Tensor, int]:
    """PPMoE's dispatch and local combine: for each of this rank's experts (global index
    first + i), the rows of x whose kept choices chose it (an index slice), through the
    expert, weighted, added at their tokens. Returns (partial output, rows computed); the
    all-reduce of the partials is the layer's output."""
    partial = x.new_zeros(x.shape)
    rows = 0
    for i, module in enumerate(experts):
        token, choice = torch.nonzero((expert == first + i) & kept, as_tuple=True)
        rows += len(token)
        partial = partial.index_add(0, token, module(x[token])
                                    * weight[token, choice].unsqueeze(-1))
    return partial, rows


class PipelineMoE(nn.Module):
    """This rank's experts of a one-process MoELayer (`twin`), for tokens every rank of
    `group` holds alike."""

    def __init__(self, twin: MoELayer, group=None) -> None:
        super().__init__()
        num_experts = len(twin.experts)
        self.group, self.per_rank = group, experts_per_rank(num_experts, group)
        self.first = rank(group) * self.per_rank
        if not isinstance(twin.rule, TopKCapacity):
            raise ValueError(f"PipelineMoE routes by top-k with capacity; got {twin.rule!r}")
        self.rule = twin.rule  # every rank routes all tokens alike, with the twin's rule
        self.gate = copy.deepcopy(twin.gate)
        self.experts = nn.ModuleList(copy.deepcopy(twin.experts[self.first + i])
                                     for i in range(self.per_rank))
        self.shared = copy.deepcopy(twin.shared) if twin.shared is not None else None
        self.last_routing = None
        self.rows_computed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_parallel_region(x, self.group)
        routing = self.rule.route(self.gate(x))
        self.last_routing = routing
        with record("compute", "experts (index slice)"):
            partial, self.rows_computed = partial_output(x, routing.expert, routing.weight,
                                                         routing.kept, self.experts, self.first)
        if self.shared is not None and rank(self.group) == 0:
            partial = partial + self.shared(x)
        return reduce_from_parallel_region(partial, self.group)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The gate's and the shared expert's: sum their gradients over the group."""
        shared = list(self.shared.parameters()) if self.shared is not None else []
        return list(self.gate.parameters()) + shared
