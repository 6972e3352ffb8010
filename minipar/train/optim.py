"""The optimizer side of a step: the learning rate's warmup and cosine decay, and
clipping by the global gradient norm across shards (AdamW itself: model_part.py).

The global norm is a classic bug of composed training (torchtitan#2318 reported grad
norms 8x apart between its DDP/HSDP and FSDP layouts of one run): every gradient entry
must count exactly once. A rank sums the
squares of the entries it owns: a tensor-parallel shard's own slice, a ZeRO rank's own
slice, a pipeline stage's own layers; a tensor replicated over tp is owned by one tp
rank only. One all-reduce of those sums over the ranks that hold distinct entries then
gives the norm one process would compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .. import collectives
from ..runtime import device
from .config import OptimConfig


def learning_rate(step: int, optim: OptimConfig, steps: int) -> float:
    """Linear warmup from 0 to lr over warmup_steps, then a cosine down to min_lr at the
    last step (`step` counts from 0)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps  # step 0 already moves a little
    span = max(steps - 1 - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def squared_norm(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Sum of squares of the entries this rank owns, in float64 (so the order in which
    ranks add their sums moves nothing that matters)."""
    total = torch.zeros((), dtype=torch.float64, device=device())
    for g in grads:
        if g is not None:
            total += g.detach().to(torch.float64).pow(2).sum()
    return total


def global_norm(owned: Iterable[torch.Tensor | None],
                groups: Iterable[dist.ProcessGroup | None] = ()) -> float:
    """The gradient norm one process would compute: this rank's owned entries' squares,
    summed over every group in `groups` (the dimensions whose ranks own distinct entries:
    ZeRO's dp, tp, pp), then the square root."""
    total = squared_norm(owned)
    for group in groups:
        total = collectives.all_reduce(total.reshape(1), group=group).reshape(())
    return math.sqrt(total.item())


def clip_(grads: Iterable[torch.Tensor | None], norm: float, max_norm: float) -> None:
    """Scale every gradient by max_norm / norm when the norm exceeds it, as
    torch.nn.utils.clip_grad_norm_ does (the same 1e-6 guard)."""
    scale = max_norm / (norm + 1e-6)
    if max_norm <= 0 or scale >= 1.0:  # torch clamps the factor at 1: never scaled up
        return
    for g in grads:
        if g is not None:
            g.mul_(scale)
