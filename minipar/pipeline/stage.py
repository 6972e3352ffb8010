"""The engine's extension point: a `Stage` is one pipeline stage's compute.

The engine (engine.py) moves tensors between actions and ranks; a Stage decides what F,
B, I and W do with them. `Stage` itself is plain synchronous training: forward calls the
module, backward adds the weight gradients into `.grad` and returns the input gradient.
A variant subclasses it in its own file beside its schedule (pipedream.py stashes
weights, terapipe.py back-propagates state shared between micro-batches) and its
schedule family builds it (`ScheduleFamily.stage`). Recomputation or mixed precision
wrap `forward` the same way: it is the one place a stage's module is called.

`SavedActivationMeter` measures the activation memory a schedule really holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


class Stage:
    """Stage `index` of the model, running `module`. Every method gets the micro-batch it
    works on, so a variant can keep per-micro-batch state."""

    # whether forward leaves no state behind for backward to consume beyond autograd's own
    # (weight stashing and carried state do): only then can a forward run without backward
    pure_forward = True

    def __init__(self, module: nn.Module, index: int) -> None:
        self.module, self.index = module, index

    def trainable(self) -> list[nn.Parameter]:
        """The parameters whose gradients backward computes."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        """The stage's output for input `x` (a leaf requiring grad, unless data)."""
        return self.module(x)

    def backward(self, microbatch: int, root: torch.Tensor, grad_out: torch.Tensor | None,
                 x: torch.Tensor | None) -> torch.Tensor | None:
        """B: back-propagate `grad_out` from `root` (the output; the loss on the last stage,
        with grad_out None); add the weight gradients into .grad; return d root / d x
        (None when x is None: stage 0's input is data)."""
        params = self.trainable()
        wrt = ([x] if x is not None else []) + params
        grads = list(torch.autograd.grad([root], wrt, [grad_out], allow_unused=True)) \
            if wrt else []
        grad_x = grads.pop(0) if x is not None else None
        accumulate(params, grads)
        return grad_x

    def backward_input(self, microbatch: int, root: torch.Tensor,
                       grad_out: torch.Tensor | None, x: torch.Tensor | None
                       ) -> torch.Tensor | None:
        """I: the input gradient only, keeping the graph for W (the zero-bubble split)."""
        if x is None:
            return None
        # retain_graph: W walks the same graph again for the weight gradients
        (grad_x,) = torch.autograd.grad(root, [x], grad_out, retain_graph=True)
        return grad_x

    def backward_weight(self, microbatch: int, root: torch.Tensor,
                        grad_out: torch.Tensor | None) -> None:
        """W: the weight gradients from the graph I kept, added into .grad."""
        params = self.trainable()
        if params:
            accumulate(params, torch.autograd.grad(root, params, grad_out, allow_unused=True))


def accumulate(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """Add each gradient into .grad in place (as backward() does); a gradient that shares
    memory with another one of this call is copied first, so no two .grads alias."""
    taken: set[int] = set()
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is not None:
            p.grad.add_(g)
        else:
            # autograd may hand the same storage to two parameters (e.g. an expand's
            # gradient); a later add_ into one .grad would silently change the other
            p.grad = g.clone() if g.untyped_storage().data_ptr() in taken else g
            taken.add(g.untyped_storage().data_ptr())


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationMeter:
    """Bytes of tensors autograd keeps for backward (parameters excluded; a storage saved
    by several nodes counts once), now and at peak: the activation memory a schedule
    really holds, measured rather than counted."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.now, self.peak = exclude, 0, 0
        self._refs: dict[tuple[int, int], int] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Count what autograd saves inside the block (the hooks come off even if it
        raises)."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Held:
        if tensor.untyped_storage().data_ptr() in self.exclude:
            return tensor
        key = (tensor.data_ptr(), tensor.numel())  # a micro-batch view counts its own bytes
        nbytes = tensor.numel() * tensor.element_size()
        if self._refs.get(key, 0) == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self._refs[key] = self._refs.get(key, 0) + 1
        held = _Held(tensor)
        # released when autograd drops the saved tensor (its graph freed after backward)
        weakref.finalize(held, self._release, key, nbytes)
        return held

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.now -= nbytes
            del self._refs[key]

    @staticmethod
    def unpack(held: torch.Tensor | _Held) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held
