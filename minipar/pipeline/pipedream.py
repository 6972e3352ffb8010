"""PipeDream (Narayanan et al. 2019): 1F1B without the flush. Each micro-batch's backward
updates its stage's weights at once, so a stage runs forwards on newer weights than the
backwards it still owes; weight stashing keeps, per micro-batch, the weights its forward
used, and its backward differentiates (and updates from) those."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .one_f_one_b import OneFOneB
from .stage import Stage


class PipeDream(OneFOneB):
    """1F1B's order; the engine runs it with `StashingStage`, which needs an lr."""

    name = "pipedream"

    def stage(self, module: nn.Module, index: int, lr: float | None = None) -> Stage:
        if lr is None or lr <= 0:
            raise ValueError("'pipedream' updates the weights after every micro-batch's "
                             "backward: pass lr > 0 (the SGD learning rate)")
        return StashingStage(module, index, lr)


class StashingStage(Stage):
    """A stage whose forward runs on a stashed copy of its weights and whose backward
    steps the live weights by SGD with `lr` at once. `versions_used[mb]` is (weights
    version its forward ran on, live version when its backward ran): the gap is
    PipeDream's staleness, which the stash hides from the gradient."""

    pure_forward = False  # forward stashes a copy of the weights that backward consumes

    def __init__(self, module: nn.Module, index: int, lr: float) -> None:
        super().__init__(module, index)
        self.lr, self.version = lr, 0
        self.stashes: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        self.versions_used: dict[int, tuple[int, int]] = {}

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        stash = {n: p.detach().clone().requires_grad_(True)
                 for n, p in self.module.named_parameters()}
        self.stashes[microbatch] = (stash, self.version)
        # the module's code on the stashed tensors: its live parameters stay untouched
        return torch.func.functional_call(self.module, stash, (x,))

    def backward(self, microbatch: int, root: torch.Tensor, grad_out: torch.Tensor | None,
                 x: torch.Tensor | None) -> torch.Tensor | None:
        stash, version = self.stashes.pop(microbatch)
        self.versions_used[microbatch] = (version, self.version)
        live = dict(self.module.named_parameters())
        names = [n for n, p in live.items() if p.requires_grad]
        wrt = ([x] if x is not None else []) + [stash[n] for n in names]
        grads = list(torch.autograd.grad([root], wrt, [grad_out], allow_unused=True)) \
            if wrt else []
        grad_x = grads.pop(0) if x is not None else None
        with torch.no_grad():  # apply this micro-batch's gradient right away
            for n, g in zip(names, grads, strict=True):
                if g is not None:
                    live[n] -= self.lr * g
        self.version += 1
        return grad_x

    def backward_input(self, microbatch: int, root: torch.Tensor,
                       grad_out: torch.Tensor | None, x: torch.Tensor | None) -> None:
        raise ValueError("PipeDream's stage updates its weights in B; it has no I/W split")

    backward_weight = backward_input


def versions_used(stages: Mapping[int, Stage]) -> dict[tuple[int, int], tuple[int, int]]:
    """{(stage, micro-batch): (weights version its forward ran on, live version when its
    backward ran)} over a Pipeline's stages (`pipe.stages`) run under 'pipedream'."""
    return {(s, mb): used for s, stage in sorted(stages.items())
            if isinstance(stage, StashingStage) for mb, used in stage.versions_used.items()}
