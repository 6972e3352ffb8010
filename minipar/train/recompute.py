"""Activation recomputation: keep less of forward, compute it again in backward.

- none: every activation backward needs is kept.
- selective (Korthikanti et al. 2022): only the attention core (RoPE, the head split,
  softmax(QK^T)V) is recomputed: the part whose saved tensors grow with the sequence
  squared in an unfused implementation, for a few percent of the FLOPs.
- full: each block keeps only its input and runs its forward again in backward (about
  one more forward pass: 4/3 of the step's matmul FLOPs).

Both plug into the decoder's own extension points (every attention module's `core`, the
fused one, tensor-parallel heads' or ring attention's; `Decoder.run_block` and the mesh
layers' `run_block`) through torch.utils.checkpoint; the arithmetic is the same, so the
loss curve is too. Apply a policy once: applying it again would nest the checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

POLICIES = ("none", "selective", "full")


def recomputed(fn: Callable) -> Callable:
    """`fn`, its inner activations not kept: checkpoint runs it again in backward."""
    # use_reentrant=False: the non-reentrant checkpoint, which torch recommends and which
    # works with hooks and arguments that are not tensors
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


def apply_recompute(model: nn.Module, policy: str) -> None:
    """Set every block in `model` (a Decoder, or a mesh's layers) to recompute by `policy`
    (one of POLICIES): full wraps each `run_block`, selective each attention `core` (the
    fused one, tensor-parallel heads' or ring attention's alike)."""
    if policy not in POLICIES:
        raise ValueError(f"recompute must be one of {', '.join(POLICIES)}; got {policy!r}")
    for module in model.modules():
        if policy == "full" and hasattr(module, "run_block"):
            module.run_block = recomputed(module.run_block)
        elif policy == "selective" and hasattr(module, "core"):
            module.core = recomputed(module.core)
