"""1F1B (PipeDream-Flush, Narayanan et al. 2021): GPipe's bubble with less memory. Its
order is shared: PipeDream (pipedream.py) runs the same order without the flush."""

from __future__ import annotations

from .family import ScheduleFamily
from .plan import Action, ActionKind


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Warm up with p-1-r forwards, then alternate one forward and one backward, then
    drain: at most p - r micro-batches are in flight on rank r."""
    F, B = ActionKind.F, ActionKind.B  # noqa: N806
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(r, F, warmup + i), Action(r, B, i)]
        order += [Action(r, B, i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


class OneFOneB(ScheduleFamily):
    """Warm up with p-1-r forwards on rank r, then one forward and one backward in turn."""

    name = "1f1b"

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        return one_f_one_b(p, m)
