"""A schedule family: one schedule's rules and its compute order, in one object.

A family says which (ranks, micro-batches, virtual stages) it can run (`check`, raising
ValueError naming the constraint), writes each rank's compute order (`orders`), and
builds the validated plan with its sends and receives (`build`). `stage` makes the
engine's Stage for it: plain synchronous training unless the family needs its own
(PipeDream's stashing stage, TeraPipe's carried state).
"""

from __future__ import annotations

from torch import nn

from .plan import Action, Schedule, add_communication
from .simulate import validate
from .stage import Stage


def _positive(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an int >= 1; got {value!r}")


# name -> family, in the order schedules.py registers them (menus and messages list them so)
SCHEDULES: dict[str, ScheduleFamily] = {}


class ScheduleFamily:
    """Base of every schedule: subclasses set `name`, write `orders` and add rules to
    `check`. With v virtual stages per rank there are p·v stages and stage j lives on
    rank j % p."""

    name: str = ""
    takes_virtual: bool = False  # may hold several (virtual) stages per rank
    split_backward: bool = False  # a backward may be I then W instead of B
    placement: str = "loop"  # which rank holds stage j (plan.Schedule.rank_of)
    stages_per_rank: int | None = None  # a family that holds a fixed number (a V: 2)

    def check(self, ranks: int, microbatches: int, virtual: int = 1) -> None:
        """Raise ValueError naming the rule a combination breaks."""
        for label, value in (("ranks", ranks), ("microbatches", microbatches),
                             ("virtual", virtual)):
            _positive(label, value)
        if virtual > 1 and not self.takes_virtual:
            takers = tuple(name for name, f in SCHEDULES.items() if f.takes_virtual)
            raise ValueError(f"virtual stages apply to {takers} only; {self.name!r} needs "
                             "virtual=1")
        if self.stages_per_rank is not None and virtual != self.stages_per_rank:
            raise ValueError(f"{self.name!r} holds exactly {self.stages_per_rank} stages per "
                             f"rank: virtual must be {self.stages_per_rank}; got {virtual}")

    def fits(self, ranks: int, microbatches: int, virtual: int = 1) -> bool:
        """Whether `check` accepts the combination."""
        try:
            self.check(ranks, microbatches, virtual)
        except ValueError:
            return False
        return True

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        """Each rank's compute actions (F, B or I and W) in order."""
        raise NotImplementedError

    def overlapped(self, p: int, m: int, v: int) -> frozenset[tuple[Action, Action]]:
        """The (F, B) pairs of `orders` a machine that overlaps them runs as one chunk
        (DualPipe's F&B); none unless the family says so."""
        return frozenset()

    def build(self, ranks: int, microbatches: int, virtual: int = 1) -> Schedule:
        """The checked plan with its sends and receives, validated by a replay."""
        self.check(ranks, microbatches, virtual)
        plan = Schedule(self.name, ranks, microbatches, virtual,
                        split_backward=self.split_backward, placement=self.placement,
                        overlapped=self.overlapped(ranks, microbatches, virtual))
        plan.actions = add_communication(plan, self.orders(ranks, microbatches, virtual))
        validate(plan)
        return plan

    def stage(self, module: nn.Module, index: int, lr: float | None = None) -> Stage:
        """The engine's Stage for stage `index` (lr: for stages that update their weights
        themselves; synchronous ones leave the gradients in .grad)."""
        return Stage(module, index)
