"""Numerics of a step: the dtype the model is built in, autocast for bf16 and fp16, and
fp16's dynamic loss scaler whose overflow every rank agrees on.

Mixed precision keeps the weights (the "master" copy), their gradients, the gradient
reduction and Adam's state in float32, and runs the matmuls of forward and backward in
16 bits under `torch.autocast` (Micikevicius et al. 2018). bf16 has float32's exponent
range, so nothing overflows; fp16's range is small, so the loss is multiplied by a
scale S before backward (small gradients would flush to zero otherwise) and the
gradients divided by S before the step. When any gradient entry on ANY rank is inf or
nan, every rank must skip that step and halve S together: a rank that skipped alone
would leave the replicas (or the shards of one model) holding different weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
from torch import nn

from .. import collectives
from ..pipeline import Stage
from ..runtime import device, world_size
from ..runtime.device import autocast_device_type

# what the model's parameters are built in; bf16, fp16 and fp8 keep float32 masters
PARAM_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.float32,
                "fp16": torch.float32, "fp8": torch.float32}
# fp8 is emulated (fp8.py): its matmuls run in float32, so MFU divides by float32's peak
COMPUTE_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16,
                  "fp16": torch.float16, "fp8": torch.float32}


def autocast(precision: str):
    """The context a forward runs in: autocast to 16 bits for bf16 and fp16, else nothing."""
    if precision in ("bf16", "fp16"):
        return torch.autocast(autocast_device_type(), dtype=COMPUTE_DTYPES[precision])
    return nullcontext()


class LossScaler:
    """fp16's dynamic loss scale (as torch's GradScaler and Megatron's): start at
    `scale`, halve it on an overflow (and skip that step), double it after `interval`
    steps in a row without one. `enabled=False` is a scale of 1 that never changes."""

    def __init__(self, enabled: bool, scale: float = 2.0**16, interval: int = 200) -> None:
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.interval, self.good_steps = interval, 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, owned: Iterable[torch.Tensor | None], groups=(None,)) -> bool:
        """Divide this rank's gradients by the scale; True if any entry of any rank's is
        not finite. `groups`: the process groups whose ranks must agree (every rank of
        the run: the whole world, None)."""
        if not self.enabled:
            return False
        grads = [g for g in owned if g is not None]
        bad = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([float(bad)], dtype=torch.float64, device=device())
        for group in groups:
            if world_size(group) > 1:
                # max over the ranks: one rank's inf is everyone's overflow
                flag = collectives.all_reduce(flag, op="max", group=group)
        overflow = bool(flag.item())
        if not overflow:
            for g in grads:
                g.div_(self.scale)
        return overflow

    def update(self, overflow: bool) -> None:
        """After the step (or the skip): halve on overflow, double after a clean run."""
        if not self.enabled:
            return
        if overflow:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
            return
        self.good_steps += 1
        if self.good_steps % self.interval == 0:
            self.scale *= 2


def make_stage(precision: str) -> Callable[[nn.Module, int], Stage]:
    """The pipeline's stage for a precision: emulated FP8 (fp8.py), else autocast."""
    if precision == "fp8":
        from .fp8 import Fp8Stage

        return Fp8Stage
    return lambda module, index: AutocastStage(module, index, precision)


class AutocastStage(Stage):
    """A pipeline stage whose forward runs in the run's precision (the engine's extension
    point): autocast around the module's call, backward as autograd recorded it."""

    def __init__(self, module: nn.Module, index: int, precision: str) -> None:
        super().__init__(module, index)
        self.precision = precision

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        with autocast(self.precision):
            return self.module(x)
