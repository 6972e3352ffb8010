"""TeraPipe (Li et al. 2021) in the engine: the micro-batches are slices of one sequence's
tokens, in order, through stages that cache keys and values
(`context_parallel.terapipe.TokenStage`). Forward as GPipe; backward from the last slice
to the first, because a slice's keys and values are used by every later slice, whose
backward must add its share of their gradient first. The slices share state, so the
stage's backward also back-propagates that state (`CarriedStateStage`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .family import ScheduleFamily
from .plan import Action, ActionKind
from .stage import Stage, backward_into_grad


class CarriesState(Protocol):
    """A module whose micro-batches share state: for micro-batch `mb`, `carried_state`
    gives extra roots (with their gradients) and extra leaves its graph read;
    `take_gradients` gets the leaves' gradients."""

    def carried_state(self, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                              list[torch.Tensor]]: ...

    def take_gradients(self, mb: int, grads: list[torch.Tensor | None]) -> None: ...


class TeraPipe(ScheduleFamily):
    """GPipe's forwards, backwards in reverse slice order, run by `CarriedStateStage`."""

    name = "terapipe"

    def orders(self, p: int, m: int, v: int) -> list[list[Action]]:
        F, B = ActionKind.F, ActionKind.B  # noqa: N806
        return [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in reversed(range(m))]
                for r in range(p)]

    def stage(self, module: nn.Module, index: int, lr: float | None = None) -> Stage:
        return CarriedStateStage(module, index)


class CarriedStateStage(Stage):
    """B also back-propagates the module's extra roots (a slice's keys and values, with the
    gradient later slices sent them) and hands it the gradients of its extra leaves (the
    earlier slices' cached keys and values): the module is a `CarriesState`. A module
    without `carried_state` runs as a plain Stage."""

    pure_forward = False  # a slice's forward caches keys and values for the later slices

    def backward(self, microbatch: int, root: torch.Tensor, grad_out: torch.Tensor | None,
                 x: torch.Tensor | None) -> torch.Tensor | None:
        carried = getattr(self.module, "carried_state", None)
        if carried is None:
            return super().backward(microbatch, root, grad_out, x)
        more_roots, more_grads, leaves = carried(microbatch)
        inputs = [x] if x is not None else []
        grads = backward_into_grad([root, *more_roots], [grad_out, *more_grads],
                                   inputs + leaves, self.trainable())
        if leaves:
            self.module.take_gradients(microbatch, grads[len(inputs):])
        return grads[0] if inputs else None
