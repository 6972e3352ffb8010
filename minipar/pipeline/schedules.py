"""Pipeline schedules: one `ScheduleFamily` per schedule, owning its rules and writing
the compute order per rank; `schedule` finds the family by name and builds the plan
(sends and receives added by `plan.add_communication`, validated by a replay).

The synchronous families live here; 1F1B, whose order PipeDream reuses, in one_f_one_b.py;
a variant lives in its own file with its schedule (zero_bubble.py, pipedream.py,
terapipe_schedule.py, v_schedules.py).
With v virtual stages per rank there are p·v stages and stage j lives on rank j % p
(a V's families place them down and back: plan.py).
"""

from __future__ import annotations

from .family import SCHEDULES, ScheduleFamily
from .one_f_one_b import OneFOneB
from .pipedream import PipeDream
from .plan import Action, ActionKind, Schedule
from .terapipe_schedule import TeraPipe
from .v_schedules import DualPipeV, ZeroBubbleV
from .zero_bubble import ZeroBubbleH1

F, B = ActionKind.F, ActionKind.B


class Naive(ScheduleFamily):
    """The whole batch through the stages one after another: no micro-batches, no overlap."""

    name = "naive"

    def check(self, ranks: int, microbatches: int, virtual: int = 1) -> None:
        super().check(ranks, microbatches, virtual)
        if microbatches != 1:
            raise ValueError("'naive' runs the whole batch at once: microbatches must be 1 "
                             "(use 'gpipe' to split the batch)")

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        return [[Action(r, F, 0), Action(r, B, 0)] for r in range(p)]


class GPipe(ScheduleFamily):
    """GPipe (Huang et al. 2019): every micro-batch's forward, then every backward."""

    name = "gpipe"

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        return [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)]
                for r in range(p)]


class Interleaved(ScheduleFamily):
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): each rank holds v chunks
    (stages r, r+p, ...); micro-batches go through the chunks in groups of p."""

    name = "interleaved_1f1b"
    takes_virtual = True

    def check(self, ranks: int, microbatches: int, virtual: int = 1) -> None:
        super().check(ranks, microbatches, virtual)
        if microbatches % ranks:  # the groups of p micro-batches must be full
            raise ValueError(f"'interleaved_1f1b' sends micro-batches through the chunks in "
                             f"groups of ranks={ranks}: microbatches must be a multiple of "
                             f"{ranks}; got {microbatches}")

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        orders = []
        total = m * v
        for r in range(p):
            def forward(k: int, r: int = r) -> Action:
                chunk = (k // p) % v
                return Action(chunk * p + r, F, (k // (p * v)) * p + k % p)

            def backward(k: int, r: int = r) -> Action:
                chunk = v - 1 - (k // p) % v
                return Action(chunk * p + r, B, (k // (p * v)) * p + k % p)

            # Megatron-LM's warm-up: enough forwards to fill every chunk of the ranks below
            warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
            order = [forward(k) for k in range(warmup)]
            for k in range(total - warmup):
                order += [forward(warmup + k), backward(k)]
            order += [backward(k) for k in range(total - warmup, total)]
            orders.append(order)
        return orders


class LoopedBFS(ScheduleFamily):
    """Breadth-first (Lamy-Poirier 2023): every micro-batch through one chunk before the
    next chunk."""

    name = "looped_bfs"
    takes_virtual = True

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        orders = []
        for r in range(p):
            order = [Action(c * p + r, F, i) for c in range(v) for i in range(m)]
            order += [Action(c * p + r, B, i) for c in reversed(range(v)) for i in range(m)]
            orders.append(order)
        return orders


for _family in (Naive(), GPipe(), OneFOneB(), PipeDream(), Interleaved(), LoopedBFS(),
                ZeroBubbleH1(), ZeroBubbleV(), DualPipeV(), TeraPipe()):
    SCHEDULES[_family.name] = _family
VIRTUAL = tuple(name for name, family in SCHEDULES.items() if family.takes_virtual)


def schedule(name: str, ranks: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The named schedule for `ranks` ranks, `microbatches` micro-batches and `virtual`
    stages per rank (ranks x virtual pipeline stages), with its sends and receives,
    validated."""
    if name not in SCHEDULES:
        raise ValueError(f"name must be one of {', '.join(map(repr, SCHEDULES))}; got {name!r}")
    return SCHEDULES[name].build(ranks, microbatches, virtual)
