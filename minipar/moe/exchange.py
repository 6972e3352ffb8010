"""The exchange, an extension point: how the rows routed on each rank reach the ranks of
their experts, and the experts' outputs come back. `ExpertParallelMoE` takes one; the
routing rule does not care which.

The exchanges: the flat all-to-all (here), Tutel's hierarchical 2D all-to-all
(hierarchical.py: fewer, larger messages across nodes) and the chunked, pipelined one
(pipelining.py: Tutel / EPS-MoE overlap of the exchange with the experts). A new exchange
is one file with a subclass of `Exchange`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import collectives
from ..trace import record

# compute(arrived rows, their meta rows [n, 2] = (local expert, slot)) -> one output per row
Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Moved(torch.autograd.Function):
    """Forward: `there(x)`. Backward: the gradient goes back the way it came, `back(grad)`.
    The sizes are known both ways, so neither direction swaps counts again (as Megatron's
    _AllToAll takes both sizes)."""

    @staticmethod
    def forward(ctx, x, there, back):
        ctx.back = back
        return there(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous()), None, None


def moved(x: torch.Tensor, there: Callable[[torch.Tensor], torch.Tensor],
          back: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`there(x)`, differentiable: the gradient of the result travels by `back`."""
    return _Moved.apply(x, there, back)


def dispatch_and_combine(rows: torch.Tensor, meta: torch.Tensor, compute: Compute,
                         there: Callable[[torch.Tensor], torch.Tensor],
                         back: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """An all-at-once exchange given its two moves: the meta and the rows go `there`, the
    experts run on what arrived, their outputs come `back` (and each gradient returns the
    way its tensor came)."""
    arrived_meta = there(meta.contiguous())
    with record("all_to_all", "dispatch", tokens=int(arrived_meta.shape[0])):
        arrived = moved(rows, there, back)
    with record("compute", "experts", tokens=int(arrived_meta.shape[0])):
        out = compute(arrived, arrived_meta)
    with record("all_to_all", "combine"):
        return moved(out, back, there)


class Exchange:
    """Rows to their experts' ranks and the outputs back, the experts run in between."""

    # True when every row has arrived before the experts run, so a capacity buffer can be
    # filled; a chunked exchange runs the experts on each chunk's rows as they arrive
    all_at_once: bool = True

    def round_trip(self, rows: torch.Tensor, meta: torch.Tensor, send_counts: list[int],
                   compute: Compute, group=None) -> torch.Tensor:
        """Send `rows` (grouped by destination rank, `send_counts` of them to each) with
        their `meta` [N, 2] (local expert, slot); on arrival run `compute(arrived,
        arrived_meta)`; return the outputs for `rows`, in their order."""
        raise NotImplementedError


class FlatAllToAll(Exchange):
    """One all-to-all among all ranks of the group each way (GShard, Switch)."""

    def __repr__(self) -> str:
        return "FlatAllToAll()"

    def round_trip(self, rows: torch.Tensor, meta: torch.Tensor, send_counts: list[int],
                   compute: Compute, group=None) -> torch.Tensor:
        recv_counts = collectives.swap_counts(send_counts, group)  # rows from each rank

        def there(t: torch.Tensor) -> torch.Tensor:
            return collectives.all_to_all(t, send_counts, recv_counts, group)

        def back(t: torch.Tensor) -> torch.Tensor:
            return collectives.all_to_all(t, recv_counts, send_counts, group)

        return dispatch_and_combine(rows, meta, compute, there, back)
