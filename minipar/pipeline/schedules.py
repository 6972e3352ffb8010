"""Pipeline schedules: each generator writes the compute order per rank; `schedule`
adds the sends and receives (`plan.add_communication`) and validates the result.

With v virtual stages per rank there are p·v stages and stage j lives on rank j % p.
"""

from __future__ import annotations

from .plan import Action, Schedule, add_communication
from .simulate import validate

# --- generators: compute order per rank ---

def _naive(p: int, m: int, v: int) -> list[list[Action]]:
    return [[Action(r, "F", 0), Action(r, "B", 0)] for r in range(p)]


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
            for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """Warm up with p-1-r forwards, then alternate one forward and one backward, then
    drain: at most p - r micro-batches are in flight on rank r."""
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(r, "F", warmup + i), Action(r, "B", i)]
        order += [Action(r, "B", i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: each rank holds v chunks (stages r, r+p, ...);
    micro-batches go through the chunks in groups of p."""
    orders = []
    total = m * v
    for r in range(p):
        def forward(k: int, r: int = r) -> Action:
            chunk = (k // p) % v
            return Action(chunk * p + r, "F", (k // (p * v)) * p + k % p)

        def backward(k: int, r: int = r) -> Action:
            chunk = v - 1 - (k // p) % v
            return Action(chunk * p + r, "B", (k // (p * v)) * p + k % p)

        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _looped_bfs(p: int, m: int, v: int) -> list[list[Action]]:
    """Breadth-first: every micro-batch through one chunk before the next chunk."""
    orders = []
    for r in range(p):
        order = [Action(c * p + r, "F", i) for c in range(v) for i in range(m)]
        order += [Action(c * p + r, "B", i) for c in reversed(range(v)) for i in range(m)]
        orders.append(order)
    return orders


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """Zero bubble H1 (Qi et al. 2023): backward split into I (input gradient, on the
    critical path) and W (weight gradient, can wait). A greedy list schedule with unit
    costs: run I as soon as its gradient arrives, F while fewer than p - r micro-batches
    are in flight (1F1B's memory), and W only to fill time that would otherwise idle.
    Greedy, not the paper's hand-tuned order: with F = I = W its bubble is below 1F1B's
    (0.20 vs 0.27 at p=4, m=8) but above the paper's optimum (0.11)."""
    done_f = [[-1.0] * m for _ in range(p)]  # finish time of F(r, i)
    done_i = [[-1.0] * m for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    clock = [0.0] * p
    next_f, next_i, next_w = [0] * p, [0] * p, [0] * p
    while any(next_w[r] < m for r in range(p)):
        progressed = False
        for r in range(p):
            if next_w[r] >= m:
                continue
            t = clock[r]
            i_ready = next_i[r] < next_f[r] and (
                r == p - 1 or 0 <= done_i[r + 1][next_i[r]] <= t)
            f_ready = next_f[r] < m and next_f[r] - next_w[r] < p - r and (
                r == 0 or 0 <= done_f[r - 1][next_f[r]] <= t)
            w_ready = next_w[r] < next_i[r]
            if i_ready:
                orders[r].append(Action(r, "I", next_i[r]))
                done_i[r][next_i[r]] = t + 1
                next_i[r] += 1
            elif f_ready:
                orders[r].append(Action(r, "F", next_f[r]))
                done_f[r][next_f[r]] = t + 1
                next_f[r] += 1
            elif w_ready:
                orders[r].append(Action(r, "W", next_w[r]))
                next_w[r] += 1
            else:
                continue
            clock[r] = t + 1
            progressed = True
        if not progressed:  # everyone waits: advance the slowest clock to the next event
            waiting = [r for r in range(p) if next_w[r] < m]
            soonest = min(clock[r] for r in waiting)
            for r in waiting:
                if clock[r] == soonest:
                    clock[r] += 1
    return orders


SCHEDULES = {"naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b, "pipedream": _one_f_one_b,
             "interleaved_1f1b": _interleaved, "looped_bfs": _looped_bfs, "zb_h1": _zb_h1}
VIRTUAL = ("interleaved_1f1b", "looped_bfs")


def schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The named schedule for `stages` ranks (pipeline stages), `microbatches` micro-batches
    and `virtual` stages per rank, with its sends and receives, validated."""
    if name not in SCHEDULES:
        raise ValueError(f"name must be one of {', '.join(map(repr, SCHEDULES))}; got {name!r}")
    for label, value in (("stages", stages), ("microbatches", microbatches),
                         ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an int >= 1; got {value!r}")
    if virtual > 1 and name not in VIRTUAL:
        raise ValueError(f"virtual stages apply to {VIRTUAL} only; {name!r} needs virtual=1")
    if name == "naive" and microbatches != 1:
        raise ValueError("'naive' runs the whole batch at once: microbatches must be 1 "
                         "(use 'gpipe' to split the batch)")
    if name == "interleaved_1f1b" and microbatches % stages:
        raise ValueError(f"'interleaved_1f1b' sends micro-batches through the chunks in groups "
                         f"of stages={stages}: microbatches must be a multiple of {stages}; "
                         f"got {microbatches}")
    compute = SCHEDULES[name](stages, microbatches, virtual)
    plan = Schedule(name, stages, microbatches, virtual,
                    split_backward=name == "zb_h1", weight_stashing=name == "pipedream")
    plan.actions = add_communication(plan, compute)
    validate(plan)
    return plan
