"""Tutel's 2D hierarchical all-to-all (Hwang et al. 2023): fewer, larger messages across
the slow links between nodes.

A flat all-to-all on K = nodes x n ranks sends every rank K-1 messages, K-n of them to
other nodes, each 1/K of its data: at scale, thousands of tiny messages, each paying the
network's latency. The hierarchical one takes two steps, ranks numbered node-major
(rank = node * n + local):

1. inside each node, an all-to-all that hands local peer j everything bound for local
   index j on any node (aggregated per destination node);
2. across nodes, among the ranks with the same local index, an all-to-all of those
   aggregates: nodes-1 messages per rank, each n times larger.

The result is the flat all-to-all's, row for row (tested). Across nodes the bytes are the
same; the messages are n times fewer. Inside a node the data moves once more.

Where the nodes are: `node_mesh()` reads them from the launcher (under torchrun, its
LOCAL_WORLD_SIZE ranks per node), or takes `per_node` to emulate them on one machine.
"""

from __future__ import annotations

import torch

from .. import collectives
from ..mesh import Mesh
from ..runtime import device, rank, ranks_per_node, world_size
from .exchange import Compute, Exchange, dispatch_and_combine


def node_mesh(per_node: int | None = None) -> Mesh:
    """This run's ranks as Mesh(node=, local=), `per_node` ranks per node: by default the
    launcher's (torchrun's LOCAL_WORLD_SIZE; ranks minipar spawned share one machine, one
    node). `node_mesh().connect()` hands out the groups the exchange takes."""
    k = world_size()
    per_node = ranks_per_node() if per_node is None else per_node
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 \
            or k % per_node:
        raise ValueError(f"per_node must divide the {k} ranks; got {per_node!r}")
    return Mesh(node=k // per_node, local=per_node)


def counts_everywhere(send_counts: list[int], local_group, node_group) -> torch.Tensor:
    """[K, K] counts[src][dst] on every rank, gathered in the same two steps (inside the
    node, then across): the hierarchical way to learn what will arrive."""
    mine = torch.tensor([send_counts], dtype=torch.int64, device=device())
    in_node = collectives.all_gather(mine, local_group)  # [n, K]
    return collectives.all_gather(in_node, node_group)  # [nodes * n, K], node-major


def rows_for_peers(pieces: list[torch.Tensor], nodes: int, per_node: int
                   ) -> list[torch.Tensor]:
    """Step 1's aggregation: `pieces[d]` holds the rows for rank d (node-major, d = b * n +
    j); local peer j gets, in node order, the pieces for (b, j) for every node b."""
    return [torch.cat([pieces[b * per_node + j] for b in range(nodes)])
            for j in range(per_node)]


def hierarchical_all_to_all(x: torch.Tensor, send_counts: list[int], local_group,
                            node_group, meters: dict | None = None,
                            counts: list[list[int]] | None = None) -> torch.Tensor:
    """`collectives.all_to_all(x, send_counts)` over all ranks, in two steps: inside the
    node (`local_group`: this node's ranks) then across nodes (`node_group`: the ranks
    with this rank's local index). Rows of x are grouped by destination rank, in order.
    `meters` (a dict) receives each step's Meter as "inside" and "across"; step 1's message
    to each local peer is `rows_for_peers`. `counts` ([K][K], every rank's send_counts)
    skips gathering them when the caller already has them."""
    n, nodes = world_size(local_group), world_size(node_group)
    me_local, me_node = rank(local_group), rank(node_group)
    k = n * nodes
    if len(send_counts) != k or sum(send_counts) != x.shape[0]:
        raise ValueError(f"send_counts must have one entry per rank ({k}) adding up to x's "
                         f"{x.shape[0]} rows; got {send_counts}")
    if counts is None:
        counts = counts_everywhere(send_counts, local_group, node_group).tolist()
    me = me_node * n + me_local
    pieces = list(torch.split(x, send_counts))  # piece d: rows for rank d
    # step 1: to local peer j, the rows for (b, j) for every node b, in node order
    to_peer = rows_for_peers(pieces, nodes, n)
    send1 = [len(t) for t in to_peer]
    source = [me_node * n + i for i in range(n)]  # my node's ranks
    recv1 = [sum(counts[s][b * n + me_local] for b in range(nodes)) for s in source]
    with collectives.meter() as inside:
        got = collectives.all_to_all(torch.cat(to_peer), send1, recv1, local_group)
    # regroup by destination node: bucket b = from each local source i, its rows for (b, me_local)
    parts = torch.split(got, [counts[s][b * n + me_local] for s in source for b in range(nodes)])
    buckets = [torch.cat([parts[i * nodes + b] for i in range(n)]) for b in range(nodes)]
    send2 = [len(t) for t in buckets]
    recv2 = [sum(counts[a * n + i][me] for i in range(n)) for a in range(nodes)]
    with collectives.meter() as across:
        out = collectives.all_to_all(torch.cat(buckets), send2, recv2, node_group)
    if meters is not None:
        meters.update(inside=inside, across=across)
    return out


class HierarchicalAllToAll(Exchange):
    """Tutel's two-step exchange both ways, over `local_group` (this node's ranks) and
    `node_group` (the ranks with this rank's local index) of a Mesh(node=, local=) whose
    ranks are the expert-parallel group's, node-major. Without groups it connects
    `node_mesh()`'s: the nodes the launcher made (every rank must construct it then)."""

    def __init__(self, local_group=None, node_group=None) -> None:
        if (local_group is None) != (node_group is None):
            raise ValueError("pass both local_group and node_group, or neither (the "
                             "launcher's nodes)")
        if local_group is None:
            groups = node_mesh().connect()
            local_group, node_group = groups.local, groups.node
        self.local_group, self.node_group = local_group, node_group

    def __repr__(self) -> str:
        return "HierarchicalAllToAll(local_group, node_group)"

    def round_trip(self, rows: torch.Tensor, meta: torch.Tensor, send_counts: list[int],
                   compute: Compute, group=None) -> torch.Tensor:
        groups = (self.local_group, self.node_group)
        # learn every rank's counts in two steps too (once), so no message crosses nodes flat
        matrix = counts_everywhere(send_counts, *groups).tolist()
        me = rank(self.node_group) * world_size(self.local_group) + rank(self.local_group)
        recv_counts = [row[me] for row in matrix]
        back_matrix = [list(column) for column in zip(*matrix, strict=True)]  # transposed

        def there(t: torch.Tensor) -> torch.Tensor:
            return hierarchical_all_to_all(t, send_counts, *groups, counts=matrix)

        def back(t: torch.Tensor) -> torch.Tensor:
            return hierarchical_all_to_all(t, recv_counts, *groups, counts=back_matrix)

        return dispatch_and_combine(rows, meta, compute, there, back)


def all_to_all_time(kind: str, nbytes: float, nodes: int, per_node: int,
                    alpha_intra: float, beta_intra: float, alpha_inter: float,
                    beta_inter: float) -> float:
    """Alpha-beta time of one rank's all-to-all of `nbytes` spread evenly over all ranks,
    messages one after another: "flat" sends K-1 messages of nbytes/K; "hierarchical"
    sends n-1 of nbytes/n inside the node, then nodes-1 of nbytes/nodes across."""
    k = nodes * per_node
    if kind == "flat":
        return (per_node - 1) * (alpha_intra + nbytes / k * beta_intra) + \
            (k - per_node) * (alpha_inter + nbytes / k * beta_inter)
    if kind == "hierarchical":
        return (per_node - 1) * (alpha_intra + nbytes / per_node * beta_intra) + \
            (nodes - 1) * (alpha_inter + nbytes / nodes * beta_inter)
    raise ValueError(f"kind must be 'flat' or 'hierarchical'; got {kind!r}")


def exchange_plan(counts: list[list[int]], nodes: int, per_node: int, kind: str
                  ) -> list[dict]:
    """What every rank holds before and after each step of a flat or hierarchical
    all-to-all, as pure arithmetic (for pictures): counts[s][d] rows go from rank s to rank
    d. Returns stages: {"holds": per rank, a list of (source, destination) per row;
    "sent": [K][K] rows sent in the step that led here (None for the start)}."""
    k = nodes * per_node
    if len(counts) != k or any(len(row) != k for row in counts):
        raise ValueError(f"counts must be {k} x {k} (nodes x per_node ranks); got "
                         f"{len(counts)} rows")
    if kind not in ("flat", "hierarchical"):
        raise ValueError(f"kind must be 'flat' or 'hierarchical'; got {kind!r}")

    def rows(s: int, d: int) -> list[tuple[int, int]]:
        return [(s, d)] * counts[s][d]

    start = {"holds": [[r for d in range(k) for r in rows(s, d)] for s in range(k)],
             "sent": None}
    final = {"holds": [[r for s in range(k) for r in rows(s, d)] for d in range(k)],
             "sent": [[counts[s][d] for d in range(k)] for s in range(k)]}
    if kind == "flat":
        return [start, final]
    n = per_node
    middle, sent1 = [], [[0] * k for _ in range(k)]
    for a in range(nodes):
        for j in range(n):
            held = []
            for i in range(n):
                s = a * n + i
                for b in range(nodes):
                    held += rows(s, b * n + j)
                    sent1[s][a * n + j] += counts[s][b * n + j]
            middle.append(held)
    sent2 = [[0] * k for _ in range(k)]
    for a in range(nodes):
        for j in range(n):
            for b in range(nodes):
                sent2[a * n + j][b * n + j] = sum(counts[a * n + i][b * n + j] for i in range(n))
    return [start, {"holds": middle, "sent": sent1}, {"holds": final["holds"], "sent": sent2}]
