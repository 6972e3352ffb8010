"""Expert parallelism: the experts of an MoE layer live on different ranks; tokens travel
to their experts by all-to-all (dispatch) and come back by all-to-all (combine).

Every rank routes its own tokens with the same (replicated) gate. To give exactly the
one-process MoELayer's result on the concatenated batch (rank 0's tokens first),
drops included, capacity and slot priority are global: each rank all-gathers how many
choices of each priority level it made for each expert, and offsets its slots by the
choices that come earlier in the global priority order. Rank r holds experts
r*E/K .. (r+1)*E/K - 1. The gate's gradient is each rank's share; sum it over ranks
(as data parallelism would) to get the one-process gradient.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import collectives
from ..runtime import rank, world_size
from ..trace import record
from .hierarchical import counts_everywhere, hierarchical_all_to_all
from .layer import MoELayer
from .lsh import LSHMoE, bucket_means, centroid_outputs, lsh_buckets
from .pipelining import pipelined_experts
from .routing import Routing, capacity, route
from .variants import DroplessMoE, ExpertChoiceMoE, global_expert_choice


def _exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
              hierarchy, matrix: list[list[int]] | None = None) -> torch.Tensor:
    if hierarchy is not None:
        return hierarchical_all_to_all(x.contiguous(), send_counts, *hierarchy, counts=matrix)
    return collectives.all_to_all(x.contiguous(), send_counts, recv_counts, group)


def _transposed(matrix: list[list[int]] | None) -> list[list[int]] | None:
    return None if matrix is None else [list(column) for column in zip(*matrix, strict=True)]


class _AllToAll(torch.autograd.Function):
    """Rows go out by send_counts; their gradients come back by the reverse exchange. The
    sizes are known, so no direction swaps counts again. With `hierarchy` (the node-local
    and cross-node groups) both directions run Tutel's two-step exchange, given every
    rank's counts (`matrix`, [K][K]; its transpose for the way back)."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, hierarchy=None, matrix=None):
        ctx.counts, ctx.group, ctx.hierarchy = (send_counts, recv_counts), group, hierarchy
        ctx.matrix = matrix
        return _exchange(x, send_counts, recv_counts, group, hierarchy, matrix)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        back = _exchange(grad, recv_counts, send_counts, ctx.group, ctx.hierarchy,
                         _transposed(ctx.matrix))
        return back, None, None, None, None, None


def global_routing(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
                   order: str, group=None) -> Routing:
    """This rank's routing, with capacity and slots as if the tokens of all ranks (of
    `group`) were one batch."""
    tokens, num_experts = logits.shape
    local = route(logits, k, float(num_experts), 1, order)  # capacity k*T: nothing drops
    counts = torch.zeros(k, num_experts, dtype=torch.int64, device=logits.device)
    for j in range(k):
        counts[j] = torch.bincount(local.expert[:, j], minlength=num_experts)
    everyone = collectives.all_gather(counts.unsqueeze(0), group).view(world_size(group), k,
                                                                         num_experts)
    total_tokens = int(collectives.all_gather(torch.tensor([tokens], device=logits.device),
                                              group).sum())
    cap = capacity(total_tokens, num_experts, k, capacity_factor, min_capacity)
    me = rank(group)
    # choices of level j land after: all levels < j of every rank, and level j of ranks < me
    per_level = everyone.sum(0)  # [k, E]: all ranks' choices at each level
    before = per_level.cumsum(0) - per_level + everyone[:me].sum(0)
    slot = torch.empty_like(local.expert)
    for j in range(k):
        one_hot = nn.functional.one_hot(local.expert[:, j], num_experts)
        within = (one_hot.cumsum(0) - 1).gather(1, local.expert[:, j:j + 1]).squeeze(1)
        slot[:, j] = within + before[j].gather(0, local.expert[:, j])
    slot = torch.where(slot < cap, slot, torch.full_like(slot, -1))
    weight = torch.where(slot >= 0, local.weight, torch.zeros_like(local.weight))
    return Routing(local.expert, slot, weight, cap, local.balance_loss, local.z_loss,
                   local.probs)


class ExpertParallelMoE(nn.Module):
    """This rank's experts of a one-process MoELayer (`twin`), with all-to-all dispatch
    among the ranks of `group` (default: all; on a mesh, its `ep` dimension). With
    `hierarchy` = (node-local group, cross-node group) of a Mesh(node=, local=) over the
    same ranks, tokens travel by Tutel's hierarchical all-to-all. With `chunks` the experts
    run on the arrived rows directly (no capacity buffer) and the dispatch is cut into
    that many chunks, the experts of each overlapped with the next chunk's dispatch and
    the previous one's combine (Tutel's pipelining; 1 = the same row-wise path without
    overlap).

    The twin's kind carries over, on the row-wise path: a `DroplessMoE` twin keeps every
    choice (no capacity); an `ExpertChoiceMoE` twin lets each expert pick its top tokens
    of the whole batch (`global_expert_choice`); an `LSHMoE` twin sends, per expert, one
    centroid per LSH bucket of this rank's tokens instead of the tokens themselves."""

    def __init__(self, twin: MoELayer, group=None, hierarchy: tuple | None = None,
                 chunks: int | None = None) -> None:
        super().__init__()
        self.kind = next((name for cls, name in ((DroplessMoE, "dropless"),
                                                 (ExpertChoiceMoE, "expert choice"),
                                                 (LSHMoE, "lsh")) if isinstance(twin, cls)),
                         "token choice")
        row_wise = self.kind != "token choice"
        if chunks is not None and chunks < 1 or hierarchy is not None and (
                chunks is not None or row_wise):
            raise ValueError(f"chunks must be None or >= 1, and hierarchy needs chunks=None "
                             f"and a plain MoELayer twin (pipelining and the {self.kind} "
                             f"twins run row-wise on the flat exchange); got chunks={chunks}")
        if row_wise and chunks is None:
            chunks = 1  # a capacity buffer would not fit these: the row-wise path
        self.group, self.hierarchy, self.chunks = group, hierarchy, chunks
        size = world_size(group)
        num_experts = len(twin.experts)
        if num_experts % size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {size} ranks; "
                             f"use a number of experts divisible by {size}")
        self.per_rank = num_experts // size
        first = rank(group) * self.per_rank
        self.k, self.capacity_factor, self.min_capacity, self.order = twin.k, \
            twin.capacity_factor, twin.min_capacity, twin.order
        if self.kind == "dropless":  # capacity = every token: nothing drops, as it routes
            self.capacity_factor = num_experts / twin.k
        self.lsh = (twin.bits, twin.compensate) if self.kind == "lsh" else None
        self.num_experts = num_experts
        self.gate = copy.deepcopy(twin.gate)
        self.experts = nn.ModuleList(copy.deepcopy(twin.experts[first + i])
                                     for i in range(self.per_rank))
        self.shared = copy.deepcopy(twin.shared) if twin.shared is not None else None
        self.last_routing: Routing | None = None
        self.tokens_received = 0
        self.last_send_counts: list[int] = []  # rows sent to each rank, last call
        self.last_rows = (0, 0)  # (token choices routed, rows sent) by this rank, last call

    def _choices(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's kept (token, expert, slot, weight), as the twin would choose them on
        the whole batch; slot is the capacity-buffer row (token choice only)."""
        if self.kind == "expert choice":
            probs = self.gate(x).softmax(-1)
            token, expert = global_expert_choice(probs, self.k, self.capacity_factor,
                                                 self.per_rank, self.group)
            self.last_routing = None
            return token, expert, torch.zeros_like(token), probs[token, expert]
        routing = global_routing(self.gate(x), self.k, self.capacity_factor, self.min_capacity,
                                 self.order, self.group)
        self.last_routing = routing
        kept = routing.kept
        token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(
            routing.expert)[kept]
        return token, routing.expert[kept], routing.slot[kept], routing.weight[kept]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token, expert, slot, weight = self._choices(x)
        chosen = x[token]
        rows, which = chosen, None
        if self.lsh is not None:  # one row per (expert, bucket): its tokens' mean
            rows, pairs, which = bucket_means(chosen, expert, lsh_buckets(x.detach(),
                                                                          self.lsh[0])[token])
            expert, slot = pairs[:, 0], torch.zeros_like(pairs[:, 0])
        owner = expert // self.per_rank
        order = torch.argsort(owner, stable=True)  # group outgoing rows by destination rank
        outgoing, expert, slot, owner = (t[order] for t in (rows, expert, slot, owner))
        send_counts = torch.bincount(owner, minlength=world_size(self.group)).tolist()
        self.last_rows = (len(token), len(rows))
        matrix = None
        if self.hierarchy is None:
            recv_counts = collectives.swap_counts(send_counts, self.group)  # rows from each
        else:  # learn the counts in two steps too (once), so no message crosses nodes flat
            matrix = counts_everywhere(send_counts, *self.hierarchy).tolist()
            recv_counts = [row[rank(self.group)] for row in matrix]
        self.last_send_counts = send_counts
        meta = torch.stack([expert % self.per_rank, slot], dim=1)
        recv_meta = _exchange(meta, send_counts, recv_counts, self.group, self.hierarchy,
                              matrix)
        self.tokens_received = int(recv_meta.shape[0])
        if self.chunks is not None:  # dispatch, experts and combine, chunk by chunk
            returned = pipelined_experts(outgoing, recv_meta[:, 0], send_counts, recv_counts,
                                         self.experts, self.chunks, self.group)
        else:
            with record("all_to_all", "dispatch", tokens=self.tokens_received):
                arrived = _AllToAll.apply(outgoing, send_counts, recv_counts, self.group,
                                          self.hierarchy, matrix)
            capacity = self.last_routing.capacity
            buffer = x.new_zeros(self.per_rank, capacity, x.shape[1])
            buffer = buffer.index_put((recv_meta[:, 0], recv_meta[:, 1]), arrived)
            with record("compute", "experts", tokens=self.tokens_received):
                out = torch.stack([e(buffer[i]) for i, e in enumerate(self.experts)])
            with record("all_to_all", "combine"):
                returned = _AllToAll.apply(out[recv_meta[:, 0], recv_meta[:, 1]], recv_counts,
                                           send_counts, self.group, self.hierarchy,
                                           _transposed(matrix))
        returned = returned[torch.argsort(order)]  # back in the order of `rows`
        if which is not None:  # every token choice takes its bucket's output
            returned = centroid_outputs(returned, which, chosen, rows, self.lsh[1])
        y = x.new_zeros(x.shape).index_add(0, token, returned * weight.unsqueeze(-1))
        return y + self.shared(x) if self.shared is not None else y
