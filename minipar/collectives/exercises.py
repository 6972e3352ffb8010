"""Lesson 01's exercise checks: ring all-reduce and tree broadcast, graded message by message.

Rank r starts with x[i] = (i + 1) * 2**r, so any message decodes exactly into which
elements it carries and which ranks have been added into it; a mistake is named by
rank, step and chunk."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, SendLog, refuse_library, run_on_ranks
from .comm import split_bounds


def _marked(rank: int, numel: int) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64, device=runtime.device()) + 1) * 2.0**rank


def _contributors(values: torch.Tensor, start: int) -> set[int] | None:
    """The set of ranks summed into a message holding elements start.., or None."""
    masks = values / (torch.arange(values.numel(), dtype=torch.float64, device=values.device)
                      + 1 + start)
    mask = masks[0].item() if values.numel() else 0.0
    if not values.numel() or not torch.all(masks == mask) or mask != int(mask) or mask < 1:
        return None
    return {r for r in range(63) if int(mask) >> r & 1}


def _call_logged(fn: Callable, numel: int, *args) -> tuple[list, list[float], list]:
    """Run the learner's `fn` on this rank: the messages its own code sent, the tensor it
    left, and the built-in collectives it handed work to (which the check refuses)."""
    tensor = _marked(runtime.rank(), numel)
    log = SendLog()
    with log as sent:
        fn(tensor, *args)
    return [(dst, t.tolist()) for dst, t in sent], tensor.tolist(), list(log.delegated)


def _delegation_problem(name: str, results: list) -> str | None:
    """The first rank whose function called a built-in collective instead of sending its
    own messages, named with the step at which it did."""
    for rank, (_, _, delegated) in enumerate(results):
        if delegated:
            step, called = delegated[0]
            return (f"rank {rank}, step {step}: called {called}, which does the whole job "
                    "itself, and the check grades the messages your own code sends. Write "
                    f"{name} with your own "
                    "sends and receives (dist.isend/irecv, dist.batch_isend_irecv, or minipar's "
                    "point-to-point send/recv)")
    return None


def _call_logged_from_each(fn: Callable, numel: int, sources: list[int]) -> list:
    """`_call_logged(fn, numel, src)` for each source in turn, on ranks started once."""
    return [_call_logged(fn, numel, src) for src in sources]


def _ring_problem(k: int, numel: int, results: list) -> str | None:
    delegated = _delegation_problem("the ring", results)
    if delegated:
        return delegated
    bounds = split_bounds(numel, k)
    total = sum(_marked(r, numel) for r in range(k))
    for step in range(2 * (k - 1)):
        for rank, (sent, _, _) in enumerate(results):
            where = f"rank {rank}, step {step}"
            if step >= len(sent):
                return (f"{where}: sent nothing; a ring all-reduce sends 2(K-1) = {2 * (k - 1)} "
                        f"messages from every rank (K-1 to reduce-scatter, K-1 to all-gather)")
            dst, values = sent[step]
            if dst != (rank + 1) % k:
                return (f"{where}: sent to rank {dst}; in a ring every rank sends only to its "
                        f"right neighbour, (rank + 1) % K = {(rank + 1) % k}")
            candidates = [c for c in range(k) if bounds[c + 1] - bounds[c] == len(values)]
            decoded = [(c, _contributors(torch.tensor(values, dtype=torch.float64), bounds[c]))
                       for c in candidates]
            decoded = [(c, who) for c, who in decoded if who is not None]
            if not decoded:
                return (f"{where}: sent {len(values)} values that are not one chunk of the "
                        f"tensor (chunks are torch.tensor_split(tensor, {k}))")
            c, who = decoded[0]
            want = min(step + 1, k)
            if step < k - 1:
                expected = {(rank - j) % k for j in range(step + 1)}
                if who != expected:
                    return (f"{where}: sent chunk {c} holding the sum of ranks {sorted(who)}; "
                            f"at reduce-scatter step {step} it should hold {want} ranks' "
                            f"contributions, {sorted(expected)} (add what you received "
                            f"before passing it on)")
            elif who != set(range(k)):
                return (f"{where}: sent chunk {c} holding the sum of ranks {sorted(who)}; in the "
                        f"all-gather phase every chunk sent is already the full sum")
    for rank, (sent, final, _) in enumerate(results):
        if len(sent) > 2 * (k - 1):
            return (f"rank {rank} sent {len(sent)} messages; a ring all-reduce needs only "
                    f"2(K-1) = {2 * (k - 1)}")
        got = torch.tensor(final, dtype=torch.float64)
        for c in range(k):
            a, b = bounds[c], bounds[c + 1]
            if not torch.equal(got[a:b], total[a:b]):
                return (f"rank {rank}: chunk {c} of the result is {got[a:b].tolist()}, "
                        f"expected {total[a:b].tolist()}")
    return None


def check_ring_all_reduce(ring_all_reduce: Callable, world_sizes: tuple[int, ...] = (2, 3, 4),
                          timeout: float = 15) -> str:
    """Run `ring_all_reduce(tensor)` (a sum, in place) on real ranks and inspect every message.

    Each message must go to the right neighbour and carry one chunk with the right
    ranks added into it: s+1 ranks at reduce-scatter step s, all ranks during the
    all-gather. The first wrong message is reported by rank and step. Only the
    learner's own messages count: a function that calls a built-in all-reduce (torch's,
    or minipar's whose messages would look right) is refused, naming the rank and step.
    """
    refuse_library("ring_all_reduce", ring_all_reduce)
    for k in world_sizes:
        numel = 2 * k + 1  # uneven chunks
        results = run_on_ranks("ring_all_reduce", _call_logged, k, ring_all_reduce, numel,
                                timeout=timeout)
        problem = _ring_problem(k, numel, results)
        if problem:
            raise ExerciseError(f"ring_all_reduce with {k} ranks: {problem}")
    return (f"ring_all_reduce: correct on {', '.join(map(str, world_sizes))} ranks, "
            "2(K-1) messages per rank, each carrying the right partial sum")


def _tree_problem(k: int, src: int, numel: int, results: list) -> str | None:
    delegated = _delegation_problem("the tree", results)
    if delegated:
        return delegated
    data = _marked(src, numel)
    rounds_allowed = math.ceil(math.log2(k))
    received_at: dict[int, int] = {src: 0}
    senders: dict[int, int] = {}
    for rank, (sent, _, _) in enumerate(results):
        if len(sent) > rounds_allowed:
            return (f"rank {rank} sent {len(sent)} messages; in a binomial tree no rank sends "
                    f"more than ceil(log2 K) = {rounds_allowed} (a root that sends to every "
                    "rank is the naive broadcast)")
        for step, (dst, values) in enumerate(sent):
            if not torch.equal(torch.tensor(values, dtype=torch.float64), data):
                return (f"rank {rank}, step {step}: sent data that is not the source's yet; a "
                        "rank can forward only after it has received")
            if dst in senders or dst == src:
                return f"rank {dst} was sent the data twice (by rank {senders.get(dst, src)})"
            senders[dst] = rank
    pending = dict(senders)
    while pending:  # a rank's round = its sender's round + its place in the sender's order
        progress = False
        for dst, sender in list(pending.items()):
            if sender in received_at:
                order = [d for d, _ in results[sender][0]].index(dst)
                received_at[dst] = received_at[sender] + order + 1
                del pending[dst]
                progress = True
        if not progress:
            return f"ranks {sorted(pending)} were sent data by ranks that never received it"
    missing = sorted(set(range(k)) - set(received_at))
    if missing:
        return f"ranks {missing} never received the data"
    rounds = max(received_at.values())
    if rounds > rounds_allowed:
        last = max(received_at, key=received_at.get)
        return (f"rank {last} gets the data only in round {rounds}; a binomial tree reaches "
                f"every rank in ceil(log2 K) = {rounds_allowed} rounds (every rank that has "
                "the data sends in every round)")
    for rank, (_, final, _) in enumerate(results):
        if not torch.equal(torch.tensor(final, dtype=torch.float64), data):
            return f"rank {rank} ends with {final}, expected the source's {data.tolist()}"
    return None


def check_tree_broadcast(tree_broadcast: Callable,
                         world_sizes: tuple[int, ...] = (2, 3, 5, 8), timeout: float = 15) -> str:
    """Run `tree_broadcast(tensor, src)` on real ranks for several K and sources.

    Every rank must end with the source's tensor, every message must carry it, each
    rank must receive once, and the last rank must have it after ceil(log2 K) rounds.
    """
    refuse_library("tree_broadcast", tree_broadcast)
    for k in world_sizes:
        sources = sorted({0, k - 1})
        results = run_on_ranks("tree_broadcast", _call_logged_from_each, k, tree_broadcast, 5,
                               sources, timeout=timeout)
        for i, src in enumerate(sources):
            problem = _tree_problem(k, src, 5, [per_source[i] for per_source in results])
            if problem:
                raise ExerciseError(f"tree_broadcast with {k} ranks from src={src}: {problem}")
    return (f"tree_broadcast: correct on {', '.join(map(str, world_sizes))} ranks, every rank "
            "reached within ceil(log2 K) rounds")
