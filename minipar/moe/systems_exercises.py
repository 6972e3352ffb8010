"""Lesson 09's exercise checks: a dispatch with uneven counts (the receivers learn them
first), and Pipeline MoE's index-slice dispatch, both graded on real ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..runtime import device, rank, world_size
from .layer import MoELayer
from .pipeline_moe import PipelineMoE, partial_output


def send_counts(source: int, world: int) -> list[int]:
    """Rows rank `source` sends each rank in the check: uneven, some pairs none at all."""
    return [(2 * source + 3 * dest) % 4 for dest in range(world)]


def _rows(source: int, world: int) -> torch.Tensor:
    """Rank `source`'s rows, grouped by destination: each row is [1000 * source + dest, i]."""
    counts = send_counts(source, world)
    rows = [[1000.0 * source + d, float(i)] for d in range(world) for i in range(counts[d])]
    return torch.tensor(rows, dtype=torch.float64, device=device()).reshape(-1, 2)


def _expected_rows(dest: int, world: int) -> torch.Tensor:
    """What rank `dest` receives: every source's rows for it, in source order."""
    pieces = [_rows(s, world) for s in range(world)]
    return torch.cat([rows[rows[:, 0] == 1000.0 * s + dest] for s, rows in enumerate(pieces)])


def _dispatch_with(fn: Callable) -> dict:
    me, k = rank(), world_size()
    out = fn(_rows(me, k), send_counts(me, k))
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    return {"rows": out.detach().reshape(-1, 2).to(torch.float64)}


def _dispatch_hint(r: int, k: int, got: torch.Tensor) -> str | None:
    want = _expected_rows(r, k)
    if got.shape == want.shape and torch.equal(got, want):
        return None
    sent = sum(send_counts(r, k))
    if got.shape[0] != want.shape[0] and got.shape[0] == sent:
        return (f"rank {r} received {got.shape[0]} rows, as many as it sends, but "
                f"{want.shape[0]} were sent to it: what arrives from rank s is what s sends, "
                "which only s knows. Exchange the counts first (an all-to-all of one count "
                "per rank), then size the receive and its splits from them")
    if got.shape == want.shape and sorted(map(tuple, got.tolist())) == \
            sorted(map(tuple, want.tolist())):
        return (f"rank {r} received the right rows in the wrong order: the pieces must come "
                "in source order, rank 0's first (output_split_sizes are the counts from "
                "each source)")
    return (f"rank {r} received {got.shape[0]} rows, expected {want.shape[0]}: rows "
            f"{want[:, 0].tolist()} (1000 x source + {r}) in source order; rank s sends rank "
            "d the rows of its d-th piece (input_split_sizes = send_counts)")


def check_uneven_dispatch(uneven_dispatch: Callable, world_sizes: tuple[int, ...] = (3, 4)
                          ) -> str:
    """`uneven_dispatch(rows, send_counts)` on every rank: rows grouped by destination,
    send_counts[d] of them for rank d (uneven, some zero). Every rank must return the rows
    sent to it, in source order: a dispatch whose receivers learn their counts first."""
    refuse_library("uneven_dispatch", uneven_dispatch)
    counts = ("crashed: its receive, sized by guess, did not match what the senders sent: "
              "exchange the counts first (an all-to-all of one count per rank), then use "
              "them as the output's split sizes")
    # the same keys as grading's defaults, so these win: here a mismatch means the counts
    hints = {"size mismatch": counts, "match expected size": counts, "split": counts}
    for k in world_sizes:
        got = run_on_ranks("uneven_dispatch", _dispatch_with, k, uneven_dispatch,
                           crash_hints=hints)
        for r, answer in enumerate(got):
            if "type" in answer:
                raise ExerciseError(f"uneven_dispatch on {k} ranks: rank {r} returned a "
                                    f"{answer['type']}; return the received rows as a tensor")
            hint = _dispatch_hint(r, k, answer["rows"])
            if hint:
                raise ExerciseError(f"uneven_dispatch on {k} ranks with send counts "
                                    f"{[send_counts(s, k) for s in range(k)]}: {hint}.")
    return (f"uneven_dispatch: every rank received its rows, in source order, on "
            f"{', '.join(map(str, world_sizes))} ranks with uneven counts")


def _twin() -> MoELayer:
    return MoELayer(8, 16, num_experts=4, k=2, capacity_factor=0.75, shared_expert=False,
                    seed=12, dtype=torch.float64)


def _partials_with(fn: Callable) -> tuple[bool, str]:
    """On one rank: the learner's partial output against this rank's share of the layer
    (PipelineMoE's all-reduce of the shares is tested to be the layer)."""
    # the twin and its input: the reference, on the host
    twin = _twin()
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(13),
                    dtype=torch.float64)
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
