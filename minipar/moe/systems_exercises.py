"""Lesson 09's exercise checks: the hierarchical all-to-all's intra-node aggregation, and
Pipeline MoE's index-slice dispatch, both graded on real ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import collectives
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..mesh import Mesh
from ..runtime import rank, world_size
from .hierarchical import hierarchical_all_to_all
from .layer import MoELayer
from .pipeline_moe import PipelineMoE, partial_output


def _exchange_with(fn: Callable, nodes: int, per_node: int) -> tuple[bool, list[int]]:
    """On one rank: the hierarchical all-to-all with the learner's aggregation, against the
    flat one; (equal?, the source ranks of the rows received, in order)."""
    groups = Mesh(node=nodes, local=per_node).connect()
    me, k = rank(), world_size()
    counts = [1 + (me + d) % 3 for d in range(k)]
    x = torch.tensor([[1000.0 * me + d] for d in range(k) for _ in range(counts[d])])
    flat = collectives.all_to_all(x, counts)
    got = hierarchical_all_to_all(x, counts, groups.local, groups.node, aggregate=fn)
    sources = [int(v) // 1000 for v in got[:, 0].tolist()]
    return bool(got.shape == flat.shape and torch.equal(got, flat)), sources


def check_rows_for_peers(rows_for_peers: Callable,
                         layouts: tuple[tuple[int, int], ...] = ((2, 2), (2, 4))) -> str:
    """`rows_for_peers(pieces, nodes, per_node)`: pieces[d] holds the rows for rank d
    (ranks node-major: d = node * per_node + local); return, for each local peer j, the
    pieces bound for local index j on every node, concatenated in node order."""
    refuse_library("rows_for_peers", rows_for_peers)
    hints = {"size": "each peer's message must hold exactly the pieces for (node b, local j) "
                     "for every node b: pieces[b * per_node + j]"}
    for nodes, per_node in layouts:
        k = nodes * per_node
        got = run_on_ranks("rows_for_peers", _exchange_with, k, rows_for_peers, nodes,
                           per_node, crash_hints={"count": hints["size"], **hints})
        for r, (same, sources) in enumerate(got):
            if same:
                continue
            raise ExerciseError(
                f"rows_for_peers on {nodes} nodes x {per_node}: rank {r} received rows from "
                f"ranks {sources} (in that order) but the flat all-to-all delivers them from "
                f"{sorted(sources)}: peer j's message must be pieces[b * per_node + j] for b "
                "= 0, 1, ... in node order, so that after the exchange across nodes every "
                "source arrives in rank order.")
    return (f"rows_for_peers: the two-step exchange equals the flat all-to-all on "
            f"{', '.join(f'{a} x {b}' for a, b in layouts)} ranks")


def _twin() -> MoELayer:
    return MoELayer(8, 16, num_experts=4, k=2, capacity_factor=0.75, shared_expert=False,
                    seed=12, dtype=torch.float64)


def _partials_with(fn: Callable) -> tuple[bool, str]:
    """On one rank: the learner's partial output against this rank's share of the layer
    (PipelineMoE's all-reduce of the shares is tested to be the layer)."""
    twin = _twin()
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    layer = PipelineMoE(twin)
    twin(x)
    routing = twin.last_routing
    assert not routing.kept.all(), "the check's tokens must overflow some expert"
    args = (x, routing.expert, routing.weight, routing.kept)
    mine = fn(*args, layer.experts, layer.first)
    mine = torch.as_tensor(mine[0] if isinstance(mine, tuple) else mine)
    expected, _ = partial_output(*args, layer.experts, layer.first)
    right = mine.shape == x.shape and torch.allclose(mine, expected, rtol=1e-10, atol=1e-12)
    if right:  # every rank's partial right: their all-reduce is the layer's output
        return True, ""
    if mine.shape == x.shape and torch.allclose(mine, _partial(x, routing, layer, False)):
        return False, "weight each row by its gate weight, weight[token, choice]"
    return False, ("select this rank's rows with (expert == first + i) & kept, run them "
                   "through experts[i], weight them and index_add them at their tokens")


def _partial(x, routing, layer, weighted: bool = True):
    """This rank's partial with or without the gate weights (to recognise that mistake)."""
    partial = x.new_zeros(x.shape)
    for i, module in enumerate(layer.experts):
        token, choice = torch.nonzero((routing.expert == layer.first + i) & routing.kept,
                                      as_tuple=True)
        w = routing.weight[token, choice].unsqueeze(-1) if weighted else 1.0
        partial = partial.index_add(0, token, module(x[token]) * w)
    return partial


def check_partial_output(partial_output: Callable, world_sizes: tuple[int, ...] = (2, 4)
                         ) -> str:
    """`partial_output(x, expert, weight, kept, experts, first)`: this rank's experts
    (global indices first, first + 1, ...) on the rows routed to them, weighted and added
    at their tokens; the all-reduce of every rank's partial must equal the layer."""
    refuse_library("partial_output", partial_output)
    hints = {"index": "this rank's expert i is experts[i], global index first + i; select "
                      "its rows with (expert == first + i) & kept"}
    for k in world_sizes:
        got = run_on_ranks("partial_output", _partials_with, k, partial_output,
                           crash_hints=hints)
        for r, (ok, why) in enumerate(got):
            if not ok:
                raise ExerciseError(f"partial_output on {k} ranks: rank {r}'s partial output "
                                    f"(experts {r * 4 // k}..{(r + 1) * 4 // k - 1}) is wrong: "
                                    f"{why}.")
    return (f"partial_output: the all-reduce of the partials equals the layer on "
            f"{', '.join(map(str, world_sizes))} ranks")
