"""The engine's extension point: a `Stage` is one pipeline stage's compute.

The engine (engine.py) moves tensors between actions and ranks; a Stage decides what F,
B, I and W do with them. `Stage` itself is plain synchronous training: forward calls the
module, backward adds the weight gradients into `.grad` and returns the input gradient.
A variant subclasses it in its own file beside its schedule (pipedream.py stashes
weights, terapipe_schedule.py back-propagates state shared between micro-batches) and its
schedule family builds it (`ScheduleFamily.stage`). Recomputation or mixed precision
wrap `forward` the same way: it is the one place a stage's module is called.

Backward accumulates into `.grad` the way `loss.backward()` does for a plain model
(`torch.autograd.backward(..., inputs=...)`, not `autograd.grad`), so every gradient
hook fires inside a pipeline step: data parallelism's buckets (DDP, ZeRO-2's
reduce-scatter, FSDP's) start their communication during the pipeline's backward.

`SavedActivationMeter` measures the activation memory a schedule really holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from .split_backward import Junctions


class Stage:
    """Stage `index` of the model, running `module`. Every method gets the micro-batch it
    works on, so a variant can keep per-micro-batch state."""

    # whether forward leaves no state behind for backward to consume beyond autograd's own
    # (weight stashing and carried state do): only then can a forward run without backward
    pure_forward = True

    def __init__(self, module: nn.Module, index: int) -> None:
        self.module, self.index = module, index
        self.junctions: dict[int, Junctions] = {}  # micro-batch -> what its I kept for W

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
        leaves = [x] if x is not None else []
        grads = backward_into_grad([root], [grad_out], leaves, self.trainable())
        return grads[0] if leaves else None

    def backward_input(self, microbatch: int, root: torch.Tensor,
                       grad_out: torch.Tensor | None, x: torch.Tensor | None
                       ) -> torch.Tensor | None:
        """I: the input gradient only, keeping the graph for W (the zero-bubble split) and
        the gradients that reach the weights' junctions with it (split_backward.py). No
        weight gradient is computed, so no parameter's hook fires."""
        if x is None:
            return None
        junctions = Junctions(root, x, self.trainable())
        if junctions.found:
            self.junctions[microbatch] = junctions
        # retain_graph: W goes down the same graph again for the weight gradients
        with junctions.keep() if junctions.found else nullcontext():
            (grad_x,) = torch.autograd.grad(root, [x], grad_out, retain_graph=True)
        return grad_x

    def backward_weight(self, microbatch: int, root: torch.Tensor,
                        grad_out: torch.Tensor | None) -> None:
        """W: the weight gradients from the graph I kept, added into .grad: from the
        junctions I recorded, or, where it recorded none (the first stage, whose input is
        data, or an output that does not depend on its input), from the output down."""
        junctions = self.junctions.pop(microbatch, None)
        if junctions is not None:
            junctions.weights_backward()
        else:
            backward_into_grad([root], [grad_out], [], self.trainable())


def backward_into_grad(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                       leaves: Sequence[torch.Tensor], params: Sequence[nn.Parameter]
                       ) -> list[torch.Tensor | None]:
    """Back-propagate `grads` from `roots` as far as `leaves` and `params`: the parameters'
    gradients are added into .grad by autograd itself (their hooks fire, as in
    `loss.backward()`); the leaves' gradients (a stage's input, state carried between
    micro-batches) are returned and left off the leaves."""
    inputs = [*leaves, *params]
    if not inputs:
        return []
    for leaf in leaves:
        leaf.grad = None  # what a leaf receives is this call's gradient alone
    # inputs=: gradients stop at the stage's boundary and reach only these tensors
    torch.autograd.backward(list(roots), list(grads), inputs=inputs)
    taken = []
    for leaf in leaves:
        taken.append(leaf.grad)
        leaf.grad = None
    return taken


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
        # detached: a node may save its own output, and that tensor's grad_fn is the node,
        # a cycle through C++ that no collector sees; the graph would outlive its last
        # reference (backward formulas read only the data)
        held = _Held(tensor.detach())
        # released when autograd drops the saved tensor (run with the graph not kept, or its
        # graph freed)
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
