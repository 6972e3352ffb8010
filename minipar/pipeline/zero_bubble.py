"""Zero-bubble pipelining (Qi et al. 2023), schedule ZB-H1: the backward split into I
(input gradient, which the previous stage waits for) and W (weight gradient, which no one
waits for), so W fills the bubbles. The engine's Stage already runs I and W
(`Stage.backward_input`, `Stage.backward_weight`); only the order is special."""

from __future__ import annotations

from .family import ScheduleFamily
from .plan import Action, ActionKind


class ZeroBubbleH1(ScheduleFamily):
    """ZB-H1: rank r does 1F1B's warm-up, then F and I in turn, and holds back r of its W
    passes (the last stage the most), running them where 1F1B's cool-down leaves bubbles.
    Every rank then holds at most p micro-batches, 1F1B's peak on rank 0, and with
    F = I = W the bubble shrinks from (p-1)(F+B) to (p-1)(F+I-W) per rank."""

    name = "zb_h1"
    split_backward = True

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        F, I, W = ActionKind.F, ActionKind.I, ActionKind.W  # noqa: E741, N806
        orders = []
        for r in range(p):
            order, f, i, w = [], 0, 0, 0
            for _ in range(min(p - 1 - r, m)):  # 1F1B's warm-up
                order.append(Action(r, F, f))
                f += 1
            while i < m:
                if f < m:
                    order.append(Action(r, F, f))
                    f += 1
                order.append(Action(r, I, i))
                i += 1
                while i - w > r:  # keep r weight gradients pending to fill the cool-down
                    order.append(Action(r, W, w))
                    w += 1
            order += [Action(r, W, j) for j in range(w, m)]
            orders.append(order)
        return orders
