"""Lesson 10's push-sum exercise, graded on 4 real ranks over a directed graph whose ranks
send and receive different numbers of messages (where the push-sum weights matter)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..runtime import rank

# out-peers: rank 0 sends to two ranks, rank 2 receives from two; strongly connected
IRREGULAR = {0: [1, 2], 1: [2], 2: [0, 3], 3: [0]}
STEPS = 60


def _start(r: int) -> torch.Tensor:
    return torch.tensor([float(r * r + 1), 10.0 * r], dtype=torch.float64)


def _gossip(push_sum: Callable) -> dict:
    """On one rank: STEPS push-sum steps of the learner's function; the totals of x and w
    over all ranks after each step (torch's all-reduce: a measurement, not graded)."""
    me = rank()
    x, w = _start(me), 1.0
    sources = [r for r, outs in IRREGULAR.items() if me in outs]
    totals = []
    for _ in range(STEPS):
        out = push_sum(x.clone(), w, list(IRREGULAR[me]), list(sources))
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
            return {"shape": repr(type(out).__name__)}
        x, w = out[0].to(torch.float64), float(out[1])
        total = torch.cat([x, x.new_tensor([w])])
        dist.all_reduce(total)
        totals.append(total.tolist())
    return {"z": (x / w).tolist(), "totals": totals}


def check_push_sum(push_sum: Callable) -> str:
    """`push_sum(x, w, peers, sources)` on every rank: keep 1/(d+1) of (x, w), send
    1/(d+1) to each of the d `peers`, add what arrives from `sources`; return (x, w)."""
    refuse_library("push_sum", push_sum)
    results = run_on_ranks("push_sum", _gossip, 4, push_sum, crash_hints={
        "size": "receive a buffer shaped like what is sent: x and w travel together "
                "(e.g. torch.cat([x * share, x.new_tensor([w * share])]))"})
    for r, got in enumerate(results):
        if "shape" in got:
            raise ExerciseError(f"push_sum: rank {r} returned a {got['shape']}; return a "
                                "tuple (x, w): the new numerator tensor and the new weight")
    want_x = sum(_start(r) for r in IRREGULAR)
    totals = results[0]["totals"]
    for step, total in enumerate(totals):
        x_sum, w_sum = torch.tensor(total[:-1], dtype=torch.float64), total[-1]
        if not torch.allclose(x_sum, want_x) or abs(w_sum - len(IRREGULAR)) > 1e-9:
            raise ExerciseError(
                f"push_sum: after step {step} the ranks' x add up to {x_sum.tolist()} and "
                f"their w to {w_sum:g}, but gossip must conserve both ({want_x.tolist()} "
                f"and {len(IRREGULAR)}): keep one share of (x, w) and send one share to each "
                "peer, shares of 1/(number of peers + 1), and add everything that arrives.")
    average = want_x / len(IRREGULAR)
    for r, got in enumerate(results):
        z = torch.tensor(got["z"], dtype=torch.float64)
        if not torch.allclose(z, average, rtol=1e-6, atol=1e-9):
            raise ExerciseError(
                f"push_sum: after {STEPS} steps rank {r} holds x / w = {z.tolist()}, not the "
                f"average {average.tolist()}. Here ranks receive different numbers of "
                "messages, so x alone drifts: w must travel with x (send w's share, add the "
                "weights that arrive) and the model is x / w.")
    return (f"push_sum: every rank reaches the average (x / w) in {STEPS} steps on a graph "
            f"where ranks send to 1 or 2 peers; x and w conserved at every step")
