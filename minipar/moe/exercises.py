"""Lesson 05's exercise checks: top-k routing with capacity, and all-to-all dispatch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from .routing import route

_ROUTING_CASES = [
    (torch.tensor([[4.0, 3, 0, 0], [4.0, 0, 3, 0], [4.0, 3, 0, 0], [0.0, 4, 3, 0]]), 2, 2),
    (torch.tensor([[5.0, 0, 1]] * 6), 1, 2),
    (torch.randn(10, 4, generator=torch.Generator().manual_seed(41)), 2, 3),
    (torch.randn(9, 3, generator=torch.Generator().manual_seed(42)), 3, 4),
]


def check_topk_routing(top_k_routing: Callable) -> str:
    """`top_k_routing(logits, k, capacity)` -> (expert [T, k], slot [T, k], -1 = dropped),
    with minipar's convention: choices ranked by logit, slots given to every token's first
    choice in token order, then every second choice, ..., full experts drop the choice."""
    refuse_library("top_k_routing", top_k_routing)
    for logits, k, cap in _ROUTING_CASES:
        tokens, experts = logits.shape
        want = route(logits, k, capacity_factor=cap * experts / (k * tokens))
        assert want.capacity == cap
        try:
            expert, slot = top_k_routing(logits, k, cap)
        except NotImplementedError:
            raise ExerciseError("top_k_routing: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        expert, slot = torch.as_tensor(expert), torch.as_tensor(slot)
        if expert.shape != (tokens, k) or slot.shape != (tokens, k):
            raise ExerciseError(f"top_k_routing: return two [tokens, k] = [{tokens}, {k}] "
                                f"tensors; got {tuple(expert.shape)} and {tuple(slot.shape)}")
        for t in range(tokens):
            for j in range(k):
                e, s = int(expert[t, j]), int(slot[t, j])
                we, ws = int(want.expert[t, j]), int(want.slot[t, j])
                if (e, s) != (we, ws):
                    why = ("choice j must be the expert with the (j+1)-th largest logit"
                           if e != we else
                           "slots go to every token's first choice (in token order) before "
                           "any second choice; a choice that finds its expert full gets -1")
                    raise ExerciseError(
                        f"top_k_routing(k={k}, capacity={cap}): token {t}, choice {j + 1}: you "
                        f"gave expert {e} slot {s}, expected expert {we} slot {ws} ({why})")
    return f"top_k_routing: every (token, choice) right in {len(_ROUTING_CASES)} cases"


_DISPATCH_ROWS = 24  # enough rows per destination that an unstable sort reorders them


def _dispatch_experts(rank: int, world_size: int, experts_per_rank: int) -> torch.Tensor:
    """Each rank's expert choices; rank 0 never picks the last rank's experts, so one rank
    sends zero rows to one peer (send_counts must still have an entry for it)."""
    gen = torch.Generator().manual_seed(50 + rank)
    owners = world_size - 1 if rank == 0 and world_size > 1 else world_size
    # a CPU generator draws on the host: moved just below
    experts = torch.randint(0, experts_per_rank * owners, (_DISPATCH_ROWS,), generator=gen)
    return experts.to(runtime.device())


def _call_dispatch(fn: Callable, experts_per_rank: int) -> torch.Tensor:
    me, k = runtime.rank(), runtime.world_size()
    expert = _dispatch_experts(me, k, experts_per_rank)
    rows = torch.arange(_DISPATCH_ROWS, dtype=torch.float64, device=runtime.device())
    x = rows[:, None].expand(-1, 3) + 100 * me
    return fn(x, expert, experts_per_rank)


def check_dispatch(dispatch_to_owners: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`dispatch_to_owners(x, expert, experts_per_rank)` sends row i of x to the rank that
    owns expert[i] (rank = expert // experts_per_rank) with collectives.all_to_all and
    returns the rows this rank received: grouped by source rank, in each source's row order."""
    refuse_library("dispatch_to_owners", dispatch_to_owners)
    for k in world_sizes:
        results = run_on_ranks("dispatch_to_owners", _call_dispatch, k, dispatch_to_owners, 2)
        for dst, got in enumerate(results):
            rows = [i + 100 * src for src in range(k)
                    for i, e in enumerate(_dispatch_experts(src, k, 2).tolist()) if e // 2 == dst]
            want = torch.tensor(rows, dtype=torch.float64)[:, None].expand(-1, 3)
            got = torch.as_tensor(got)
            if got.shape == want.shape and torch.equal(got, want):
                continue
            ids = [int(v) for v in got[:, 0].tolist()] if got.dim() == 2 else got.tolist()
            if sorted(ids) == rows:
                why = ("the right rows in the wrong order. Rows with the same destination "
                       "must keep their order: torch.argsort(owner) is not stable and may "
                       "shuffle ties; use torch.argsort(owner, stable=True)")
            else:
                why = ("Sort rows by destination rank (stably), and pass send_counts = rows "
                       "per destination")
            raise ExerciseError(
                f"dispatch_to_owners on {k} ranks: rank {dst} received rows {ids[:8]}... "
                f"(value = 100 x source rank + row), expected {rows[:8]}...: {why}.")
    return f"dispatch_to_owners: every rank received exactly its rows on {world_sizes} ranks"
