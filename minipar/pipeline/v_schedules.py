"""V-shaped pipelines: two stages per rank, placed down the ranks and back up, so rank r
holds stages r and 2p-1-r and the last stage sits beside the first on rank 0.

Why a V: a micro-batch's forward ends on the rank where it began, so the loss's
backward starts where the warm-up's first forward ran, without a trip back across the
pipeline; and each rank holds two stages, like interleaving's chunks, without
interleaving's extra messages (stages p-1 and p share a rank: no message between them).

- **ZB-V** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism" section 6): zero-bubble's
  split backward (I, then W later) in a V, at 1F1B's peak activation memory. The paper
  calls its bubble zero when F = I = W; replayed here (`simulate`), this order leaves
  (p - 1) x I per rank, about half of ZB-H1's for the same model.
- **DualPipeV** (DeepSeek-V3's DualPipe, cut in half: DeepSeek's `dualpipev.py`, torch's
  `ScheduleDualPipeV`): in its steady state one chunk's forward runs beside the other
  chunk's backward (`Schedule.overlapped`: F&B), so on a GPU one computes while the
  other's communication (MoE's all-to-all) travels. Its bubble is
  (PP/2 - 1)(F&B + B - 3W) for PP stages, and each rank holds PP + 1 micro-batch-stages
  of activations (`dualpipe_table` derives both by simulation).

On one CPU thread F and B cannot overlap: the engine runs each pair one after the other,
so F&B = F + B here; `simulate` with `costs["F&B"]` shows what overlap would buy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .family import SCHEDULES, ScheduleFamily
from .plan import Action, ActionKind, Schedule, peak_in_flight
from .simulate import simulate

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


@dataclass
class _Order:
    """One rank's compute order as it is written: each (stage, F) and (stage, backward)
    takes the next micro-batch; an I leaves its W pending, and `weight` runs the oldest."""

    actions: list[Action] = field(default_factory=list)
    pairs: set[tuple[Action, Action]] = field(default_factory=set)
    next_mb: dict[tuple[int, str], int] = field(default_factory=dict)
    pending: list[Action] = field(default_factory=list)

    def add(self, stage: int, kind: ActionKind) -> Action:
        counter = (stage, "F" if kind == F else "backward")  # B and I share a count
        action = Action(stage, kind, self.next_mb.get(counter, 0))
        self.next_mb[counter] = action.microbatch + 1
        self.actions.append(action)
        if kind == I:
            self.pending.append(Action(stage, W, action.microbatch))
        return action

    def count(self, stage: int, kind: str) -> int:
        """How many micro-batches stage has run `kind` ("F" or "backward") for so far."""
        return self.next_mb.get((stage, kind), 0)

    def weight(self) -> None:
        if self.pending:
            self.actions.append(self.pending.pop(0))

    def overlapped(self, forward_stage: int, backward_stage: int) -> None:
        self.pairs.add((self.add(forward_stage, F), self.add(backward_stage, B)))


class VShaped(ScheduleFamily):
    """Base of the V families: two stages per rank, down and back."""

    takes_virtual = True
    stages_per_rank = 2
    placement = "v"
    split_backward = True

    def check(self, ranks: int, microbatches: int, virtual: int = 2) -> None:
        super().check(ranks, microbatches, virtual)
        if microbatches < 2 * ranks:
            raise ValueError(f"{self.name!r} fills both arms of the V: microbatches must be "
                             f">= the number of stages, 2 x ranks = {2 * ranks}; got "
                             f"{microbatches}")

    def build(self, ranks: int, microbatches: int, virtual: int = 2) -> Schedule:  # V: 2
        return super().build(ranks, microbatches, virtual)

    def written(self, p: int, m: int) -> list[_Order]:
        raise NotImplementedError

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        return [o.actions for o in self.written(p, m)]

    def overlapped(self, p: int, m: int, v: int) -> frozenset[tuple[Action, Action]]:
        return frozenset(pair for o in self.written(p, m) for pair in o.pairs)


class ZeroBubbleV(VShaped):
    """ZB-V: warm up down the V, then F, I and W of each arm in turn; the W passes held
    back fill the cool-down."""

    name = "zb_v"

    def written(self, p: int, m: int) -> list[_Order]:
        orders = []
        for r in range(p):
            o, down, up = _Order(), r, 2 * p - 1 - r
            for _ in range(2 * (p - r) - 1):  # fill the down arm below this rank
                o.add(down, F)
            for _ in range(r):
                o.add(up, F)
                o.add(down, F)
            for _ in range(p - r):  # the up arm's first micro-batches, done at once
                o.add(up, F)
                o.add(up, I)
                o.weight()
            while o.count(up, "F") < o.count(down, "F") or o.count(down, "F") < m:  # steady
                if o.count(down, "F") < m:
                    o.add(down, F)
                o.add(down, I)
                o.weight()
                o.add(up, F)
                o.add(up, I)
                o.weight()
            for _ in range(r):  # cool-down: input gradients first, weights after
                o.add(down, I)
                o.add(up, I)
            for _ in range(p - r):
                o.add(down, I)
                o.pending.sort(key=lambda a: a.stage != down)  # this arm's oldest W first
                o.weight()
            o.pending.sort(key=lambda a: (a.stage == down, a.microbatch))  # up arm, then down
            while o.pending:
                o.weight()
            orders.append(o)
        return orders


class DualPipeV(VShaped):
    """DualPipeV: warm up, then pairs of one arm's forward and the other's backward
    (F&B), then zero-bubble's split backward in the second half of the cool-down."""

    name = "dualpipev"

    def written(self, p: int, m: int) -> list[_Order]:
        orders = []
        for r in range(p):
            o, down, up = _Order(), r, 2 * p - 1 - r
            for _ in range(2 * (p - r - 1)):
                o.add(down, F)
            for _ in range(r + 1):
                o.add(down, F)
                o.add(up, F)
            for _ in range(p - r - 1):
                o.add(up, I)
                o.weight()
                o.add(up, F)
            for i in range(m - 2 * p + r + 1):  # the steady state: F&B chunks
                if i == 0 and r == p - 1:  # the V's turn: not overlapped, a shorter bubble
                    o.add(down, F)
                    o.add(up, B)
                else:
                    o.overlapped(down, up)
                o.overlapped(up, down)
            for _ in range(p - r - 1):
                o.add(up, B)
                o.overlapped(up, down)
            split, half = False, (r + 1) // 2
            for i in range(r + 1):  # the second half of these backwards leave W for later
                split = split or (i == half and r % 2 == 1)
                o.add(up, I if split else B)
                split = split or (i == half and r % 2 == 0)
                o.add(down, I if split else B)
            for _ in range(p - r - 1):
                o.weight()
                o.add(down, I if split else B)
            while o.pending:
                o.weight()
            orders.append(o)
        return orders


# DualPipe's README table, per method: (schedule, ranks for PP stages, its bubble formula)
_TABLE = (("1F1B", "1f1b", 1, "(PP-1)(F+B)"),
          ("ZB1P", "zb_h1", 1, "(PP-1)(F+B-2W)"),
          ("DualPipeV", "dualpipev", 2, "(PP/2-1)(F&B+B-3W)"))


def _formula(method: str, pp: int, c: dict[str, float]) -> float:
    fb = c.get("F&B", c["F"] + c["B"])
    return {"1F1B": (pp - 1) * (c["F"] + c["B"]),
            "ZB1P": (pp - 1) * (c["F"] + c["B"] - 2 * c["W"]),
            "DualPipeV": (pp / 2 - 1) * (fb + c["B"] - 3 * c["W"])}[method]


def dualpipe_table(pp: int, microbatches: int, costs: dict[str, float]) -> list[dict]:
    """DualPipe's comparison derived by simulating each schedule with PP stages of equal
    cost: `costs` gives one stage's F, B (the full backward), W, and optionally F&B (an
    overlapped pair; F + B when absent, as on one CPU thread); I is B - W.

    Each row: the bubble (the busiest rank's idle time in the simulated step), DualPipe's
    formula for it, parameters per device in stages (a V holds two), activations per
    device (the most micro-batch-stages one rank holds) and the devices used. The
    simulated bubble equals the formula when a forward costs what its input gradient
    costs (F = I, the equal chunks of DualPipe's figure) and W <= F; otherwise the
    critical path runs elsewhere and the simulation is the figure to trust."""
    if pp % 2 or pp < 4:
        raise ValueError(f"pp is DualPipe's PP, the number of stages: an even number >= 4 "
                         f"(DualPipeV runs it on PP/2 >= 2 ranks); got {pp}")
    c = {"I": costs["B"] - costs["W"], **costs}
    rows = []
    for method, name, per_rank, formula in _TABLE:
        # the registry schedules.py fills with this file's families and the others
        plan = SCHEDULES[name].build(pp // per_rank, microbatches, per_rank)
        timeline = simulate(plan, c)
        busy = [sum(e.duration for e in timeline.for_rank(r) if e.track == "compute")
                for r in range(plan.ranks)]
        rows.append({"method": method, "bubble": timeline.makespan - min(busy),
                     "formula": formula, "formula_value": _formula(method, pp, c),
                     "parameters_per_device": per_rank,
                     "activations_per_device": max(peak_in_flight(plan)),
                     "devices": plan.ranks, "step": timeline.makespan})
    return rows
