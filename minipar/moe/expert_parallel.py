"""Expert parallelism: the experts of an MoE layer live on different ranks; tokens travel
to their experts by all-to-all (dispatch) and come back by all-to-all (combine).

Two objects compose here: the twin's routing rule (rule.py: top-k with capacity,
dropless, expert choice, LSH centroids) says which rows go to which expert, and an
exchange (exchange.py: flat, hierarchical, chunked) moves them. Every rank routes its own
tokens with the same (replicated) gate and the twin's own rule object, whose
`choose_global` gives exactly the one-process layer's choices on the concatenated batch
(rank 0's tokens first), drops included: for top-k, capacity and slot priority are
global (top_k.global_routing). Rank r holds experts r*E/K .. (r+1)*E/K - 1. The gate's
gradient is each rank's share; sum it over ranks (as data parallelism would) to get the
one-process gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from ..runtime import rank, world_size
from .exchange import Exchange, FlatAllToAll
from .layer import MoELayer
from .pipelining import run_by_expert
from .routing import Routing


def experts_per_rank(num_experts: int, group=None) -> int:
    """How many experts each rank of `group` holds (rank r the r-th block of them); one
    line naming the fix when they do not split evenly."""
    size = world_size(group)
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {size} ranks; "
                         f"use a number of experts divisible by {size}")
    return num_experts // size


def average_experts_over_ep(experts: Iterable[nn.Parameter], ep: int) -> None:
    """Divide each expert parameter's gradient by `ep` as backward computes it (a hook,
    before it is added into .grad). An expert's gradient sums what the tokens of every
    rank of its ep group asked of it, each rank's loss a mean over its own tokens; divided
    by ep it is their mean, and data parallelism then averages it over dp only."""
    for p in experts:
        p.register_hook(lambda grad: grad / ep)


class ExpertParallelMoE(nn.Module):
    """This rank's experts of a one-process MoELayer (`twin`, or a twin of another routing
    rule), routing with the twin's `rule` among the ranks of `group` (default: all; on a
    mesh, its `ep` dimension), rows moved by `exchange` (default `FlatAllToAll()`;
    `HierarchicalAllToAll(local, node)` of a Mesh(node=, local=) over the same ranks, or
    `ChunkedAllToAll(chunks)`).

    Where the rule fills a capacity buffer (top-k) and every row arrives at once, the
    experts run on [capacity, hidden] buffers as the twin does; otherwise (dropless,
    expert choice, LSH centroids, or a chunked exchange) on the rows that arrived."""

    def __init__(self, twin: MoELayer, group=None, exchange: Exchange | None = None) -> None:
        super().__init__()
        num_experts = len(twin.experts)
        self.per_rank = experts_per_rank(num_experts, group)
        self.group = group
        self.exchange = FlatAllToAll() if exchange is None else exchange
        self.rule = twin.rule  # the twin's own rule object: its choices, by construction
        # this rank's expert i is the twin's expert first + i
        self.first = first = rank(group) * self.per_rank
        self.num_experts = num_experts
        self.gate = copy.deepcopy(twin.gate)
        self.experts = nn.ModuleList(copy.deepcopy(twin.experts[first + i])
                                     for i in range(self.per_rank))
        self.shared = copy.deepcopy(twin.shared) if twin.shared is not None else None
        self.last_routing: Routing | None = None
        self.tokens_received = 0
        self.rows_computed = 0  # rows the experts ran on, last call (a buffer's empty slots too)
        self.last_send_counts: list[int] = []  # rows sent to each rank, last call
        self.last_rows = (0, 0)  # (token choices routed, rows sent) by this rank, last call

    def _buffered(self, capacity: int, arrived: torch.Tensor, meta: torch.Tensor
                  ) -> torch.Tensor:
        """The twin's way: rows into [per_rank, capacity, hidden] by (expert, slot), each
        expert on its whole buffer (empty slots too), the rows' outputs gathered back."""
        self.tokens_received += int(arrived.shape[0])
        self.rows_computed += self.per_rank * capacity
        buffer = arrived.new_zeros(self.per_rank, capacity, arrived.shape[1])
        buffer = buffer.index_put((meta[:, 0], meta[:, 1]), arrived)
        out = torch.stack([e(buffer[i]) for i, e in enumerate(self.experts)])
        return out[meta[:, 0], meta[:, 1]]

    def _row_wise(self, arrived: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Each expert on the rows that arrived for it (no capacity buffer)."""
        self.tokens_received += int(arrived.shape[0])
        self.rows_computed += int(arrived.shape[0])
        return run_by_expert(self.experts, arrived, meta[:, 0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choices = self.rule.choose_global(self.gate(x), self.per_rank, self.group)
        self.last_routing = choices.routing
        rows, expert, slot, state = self.rule.pack(x, choices)
        owner = expert // self.per_rank
        # group outgoing rows by destination rank; stable, so each rank's rows keep the
        # rule's order and arrive in it
        order = torch.argsort(owner, stable=True)
        outgoing, expert, slot, owner = (t[order] for t in (rows, expert, slot, owner))
        send_counts = torch.bincount(owner, minlength=world_size(self.group)).tolist()
        self.last_send_counts = send_counts
        self.last_rows = (len(choices.token), len(rows))
        meta = torch.stack([expert % self.per_rank, slot], dim=1)
        if self.rule.capacity_buffer and self.exchange.all_at_once:
            capacity = choices.routing.capacity  # global: the twin's buffer size

            def compute(arrived: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
                return self._buffered(capacity, arrived, m)
        else:
            compute = self._row_wise
        self.tokens_received = self.rows_computed = 0
        returned = self.exchange.round_trip(outgoing, meta, send_counts, compute, self.group)
        returned = returned[torch.argsort(order)]  # back in the order of `rows`
        returned = self.rule.unpack(returned, state)  # one output per kept choice
        y = x.new_zeros(x.shape).index_add(0, choices.token,
                                           returned * choices.weight.unsqueeze(-1))
        return y + self.shared(x) if self.shared is not None else y
