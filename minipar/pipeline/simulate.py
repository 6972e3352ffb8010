"""Replay a schedule with modelled costs: the ideal Timeline of a pipeline, and, given a
machine's communication and engine costs, the Timeline a real run should have.

Each rank runs its actions in order. A compute action takes its kind's cost: one figure
for every rank, one per rank (the last stage also computes the loss, the first has no
input gradient to send back), or one per stage, where a rank holds several unequal stages
(a V's rank 0 holds the embedding's stage and the head's). A message lands
`costs["p2p"]` seconds after it is sent (latency plus bytes over bandwidth, e.g. from a
fitted `cost.Machine`); a receive waits until its message has landed.
`costs["overhead"]` is the engine's own time per action (Python, posting a message),
paid by every action on its rank. A plan's overlapped (F, B) pairs (DualPipe's F&B
chunks) take `costs["F&B"]` together when it is given: a machine that overlaps one
chunk's forward with another's backward; without it they take F + B, as on one CPU
thread. Events carry the plan's labels (`1F0`, `1SEND_F0`, `2RECV_F0`) and kinds (F, B,
I, W, send, recv), as the engine records them, so a simulated and a measured Timeline
can be compared action by action, drawn and summarized alike.
"""

from __future__ import annotations

import statistics

from ..trace import Event, Timeline, union_length
from .plan import Schedule, check_structure


def _per_rank(costs: dict, kind: str, ranks: int, default: float) -> list[float]:
    value = costs.get(kind, default)
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [value] * ranks
    if len(values) != ranks:
        raise ValueError(f"costs[{kind!r}] must be one number or one per rank ({ranks}); "
                         f"got {len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"costs[{kind!r}] must be >= 0 seconds; got {value!r}")
    return values


def _per_stage(costs: dict, kind: str, plan: Schedule, default: float) -> list[float]:
    """costs[kind] for each of the plan's stages: a dict {stage: seconds} as it is, a
    number or a list with one per rank given to each stage of that rank."""
    value = costs.get(kind, default)
    if not isinstance(value, dict):
        by_rank = _per_rank(costs, kind, plan.ranks, default)
        return [by_rank[plan.rank_of(s)] for s in range(plan.stages)]
    if sorted(value) != list(range(plan.stages)):
        raise ValueError(f"costs[{kind!r}] as a dict must have one entry per stage "
                         f"(0..{plan.stages - 1}); got stages {sorted(value)}")
    if any(v < 0 for v in value.values()):
        raise ValueError(f"costs[{kind!r}] must be >= 0 seconds; got {value!r}")
    return [float(value[s]) for s in range(plan.stages)]


def simulate(plan: Schedule, costs: dict[str, float | list[float] | dict[int, float]]
             ) -> Timeline:
    """The Timeline of `plan` when F, B, I, W take costs[kind] (seconds; one number, a
    list with one per rank, or a dict with one per stage), a message takes costs["p2p"]
    to land and every action costs its rank costs["overhead"] more.

    Raises ValueError naming the stuck ranks and their next actions on a deadlock.
    """
    p2p = costs.get("p2p", 0.0)
    if isinstance(p2p, (list, tuple)) or not p2p >= 0:
        raise ValueError(f"costs['p2p'] must be one number of seconds >= 0; got {p2p!r}")
    overhead = _per_rank(costs, "overhead", plan.ranks, 0.0)
    compute = {kind: _per_stage(costs, kind, plan, 1.0) for kind in ("F", "B", "I", "W")}
    fused = _per_rank(costs, "F&B", plan.ranks, 0.0) if "F&B" in costs else None
    # an overlapped pair's share of F&B: each half scaled by F&B / (its F + its B)
    pair_sum = {a: sum(compute[b.kind.value][b.stage] for b in pair)
                for pair in plan.overlapped for a in pair} if fused else {}
    clock = [0.0] * plan.ranks
    position = [0] * plan.ranks
    landed: dict[tuple[str, int, int], float] = {}  # (direction, stage sent to, mb) -> time
    events: list[Event] = []
    while True:
        progressed = False
        for r in range(plan.ranks):
            actions = plan.actions[r]
            while position[r] < len(actions):
                a = actions[position[r]]
                if a.kind.is_recv:
                    key = (a.kind.carries, a.stage, a.microbatch)
                    if key not in landed:
                        break
                    clock[r] += overhead[r]
                    start = max(clock[r], landed[key])
                    if start > clock[r]:  # blocked in the receive, as a real rank records it
                        events.append(Event(r, "recv", str(a), clock[r], start,
                                            stage=a.stage, microbatch=a.microbatch,
                                            peer=plan.rank_of(a.peer_stage)))
                    clock[r] = start
                elif a.kind.is_send:
                    clock[r] += overhead[r]
                    landed[(a.kind.carries, a.peer_stage, a.microbatch)] = clock[r] + p2p
                    if p2p:
                        events.append(Event(r, "send", str(a), clock[r], clock[r] + p2p,
                                            stage=a.stage, microbatch=a.microbatch,
                                            peer=plan.rank_of(a.peer_stage)))
                else:
                    cost = compute[a.kind.value][a.stage]
                    if a in pair_sum:
                        cost *= fused[r] / pair_sum[a]
                    clock[r] += overhead[r]
                    # Timelines hold plain strings: the kind's printed form
                    events.append(Event(r, a.kind.value, str(a), clock[r], clock[r] + cost,
                                        stage=a.stage, microbatch=a.microbatch))
                    clock[r] += cost
                position[r] += 1
                progressed = True
        if all(position[r] == len(plan.actions[r]) for r in range(plan.ranks)):
            return Timeline(events)
        if not progressed:
            stuck = {r: str(plan.actions[r][position[r]]) for r in range(plan.ranks)
                     if position[r] < len(plan.actions[r])}
            raise ValueError("deadlock: " + ", ".join(f"rank {r} waits at {a}"
                                                      for r, a in stuck.items())
                             + " and nothing it waits for can still be sent")


def in_flight_over_time(timeline: Timeline) -> dict[int, list[tuple[float, int]]]:
    """Per rank, (time, micro-batches whose activations are held) steps: +1 when an F
    ends, -1 when the backward that frees them (B, or W where backward is split) ends."""
    curves: dict[int, list[tuple[float, int]]] = {}
    for rank in timeline.ranks:
        changes = sorted((e.end, 1 if e.kind == "F" else -1) for e in timeline.for_rank(rank)
                         if e.kind in ("F", "B", "W"))
        held, points = 0, [(timeline.start, 0)]
        for t, delta in changes:
            held += delta
            points.append((t, held))
        curves[rank] = points
    return curves


def costs_from_timeline(timeline: Timeline, plan: Schedule) -> dict:
    """The costs `simulate` takes, read off a measured step's Timeline: each compute kind's
    median duration per rank, and the engine's overhead per action on each rank (the gaps
    between the rank's compute and receive events, from its first to its last, over its
    number of actions: Python and posting messages)."""
    costs: dict = {"overhead": []}
    for kind in ("F", "B", "I", "W"):
        per_rank = [[e.duration for e in timeline.for_rank(r) if e.kind == kind]
                    for r in range(plan.ranks)]
        if all(per_rank):
            costs[kind] = [statistics.median(d) for d in per_rank]
    for r in range(plan.ranks):
        mine = [(e.start, e.end) for e in timeline.for_rank(r)
                if e.track == "compute" or e.kind == "recv"]
        span = max(end for _, end in mine) - min(start for start, _ in mine) if mine else 0.0
        costs["overhead"].append(max(span - union_length(mine), 0.0) / len(plan.actions[r]))
    return costs


def bubble_budgets(plan: Schedule, costs: dict) -> dict[int, dict[int, float]]:
    """Per rank, {action index: seconds the rank waits before that action} in the
    simulated run: where a bubble is and how long, the slots PipeFisher fills with work."""
    budgets: dict[int, dict[int, float]] = {r: {} for r in range(plan.ranks)}
    for r in range(plan.ranks):
        index = {str(a): i for i, a in enumerate(plan.actions[r])}
        for e in simulate(plan, costs).for_rank(r):
            if e.kind == "recv" and e.duration > 0:
                budgets[r][index[e.label]] = budgets[r].get(index[e.label], 0.0) + e.duration
    return budgets


def simulate_bubble_work(timeline: Timeline, unit_cost: float,
                         label: str = "K-FAC") -> Timeline:
    """The simulated Timeline with units of extra work (each `unit_cost` long, e.g. K-FAC
    curvature statistics as in PipeFisher) put into every idle gap of every rank that
    fits one.
    A rank working on extra work is no longer blocked, so the receive waits go. Compare
    `.summary().bubble_fraction` before and after for the utilization gained."""
    if unit_cost <= 0:
        raise ValueError(f"unit_cost must be > 0 seconds; got {unit_cost!r}")
    extra: list[Event] = []
    for rank in timeline.ranks:
        busy = sorted((e.start, e.end) for e in timeline.for_rank(rank) if e.track == "compute")
        t = timeline.start
        for start, end in [*busy, (timeline.end, timeline.end)]:
            while start - t >= unit_cost:
                extra.append(Event(rank, "extra", label, t, t + unit_cost))
                t += unit_cost
            t = max(t, end)
    return Timeline([*(e for e in timeline.events if e.kind not in ("wait", "recv")), *extra])


def validate(plan: Schedule) -> None:
    """Raise ValueError unless the plan is well formed (`plan.check_structure`) and runs to
    the end without a deadlock (a replay with unit costs)."""
    check_structure(plan)
    simulate(plan, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})
