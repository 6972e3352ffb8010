"""An FSDP unit's life cycle in one step, moment by moment: which units are whole.

At rest every unit is a 1/K slice. Forward gathers unit i, computes it and frees it;
backward gathers it again (last unit first), computes, reduce-scatters its gradients and
frees it; the step then updates the slices. With prefetch the next unit's gather starts
while this one computes, so two units are whole at once. The order is FSDP's own
(`fsdp.FullyShardedDataParallel`); a test holds it against a real step's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Moment:
    """One action of the step (`gather`, `forward`, `free`, `backward`, `reduce-scatter`,
    `step`) on `unit` (None: every unit), and the units whole right after it."""

    action: str
    unit: int | None
    whole: frozenset[int]

    @property
    def label(self) -> str:
        return self.action if self.unit is None else f"{self.action} {self.unit}"


def unit_lifecycle(units: int, prefetch: bool = False) -> list[Moment]:
    """The moments of one FSDP step over `units` units (see the module docstring)."""
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"units must be an int >= 1; got {units!r}")
    moments: list[Moment] = []
    whole: set[int] = set()

    def act(action: str, unit: int | None, add: int | None = None,
            drop: int | None = None) -> None:
        if add is not None:
            whole.add(add)
        if drop is not None:
            whole.discard(drop)
        moments.append(Moment(action, unit, frozenset(whole)))

    for direction, order in ((+1, range(units)), (-1, range(units - 1, -1, -1))):
        for i in order:
            if i not in whole:  # not prefetched: gather now, on the critical path
                act("gather", i, add=i)
            following = i + direction
            if prefetch and 0 <= following < units:
                act("gather", following, add=following)  # in the background
            if direction > 0:
                act("forward", i)
                act("free", i, drop=i)
            else:
                act("backward", i)
                act("reduce-scatter", i)
                act("free", i, drop=i)
    act("step", None)  # Adam on each rank's slices: nothing whole
    return moments
