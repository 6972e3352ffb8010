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


def _terapipe(p: int, m: int, v: int) -> list[list[Action]]:
    """TeraPipe (Li et al. 2021): the micro-batches are slices of one sequence's tokens, in
    order. Forward as GPipe; backward from the last slice to the first, because a slice's
    keys and values are used by every later slice, whose backward must add its share of
    their gradient first."""
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in reversed(range(m))]
            for r in range(p)]


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
    """The zero-bubble paper's ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I
    (input gradient, which the previous stage waits for) and W (weight gradient, which no
    one waits for). Rank r does 1F1B's warm-up, then F and I in turn, and holds back r of
    its W passes (the last stage the most), running them where 1F1B's cool-down leaves
    bubbles. Every rank then holds at most p micro-batches, 1F1B's peak on rank 0, and
    with F = I = W the bubble shrinks from (p-1)(F+B) to (p-1)(F+I-W) per rank."""
    orders = []
    for r in range(p):
        order, f, i, w = [], 0, 0, 0
        for _ in range(min(p - 1 - r, m)):  # 1F1B's warm-up
            order.append(Action(r, "F", f))
            f += 1
        while i < m:
            if f < m:
                order.append(Action(r, "F", f))
                f += 1
            order.append(Action(r, "I", i))
            i += 1
            while i - w > r:  # keep r weight gradients pending to fill the cool-down
                order.append(Action(r, "W", w))
                w += 1
        order += [Action(r, "W", j) for j in range(w, m)]
        orders.append(order)
    return orders


SCHEDULES = {"naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b, "pipedream": _one_f_one_b,
             "interleaved_1f1b": _interleaved, "looped_bfs": _looped_bfs, "zb_h1": _zb_h1,
             "terapipe": _terapipe}
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
