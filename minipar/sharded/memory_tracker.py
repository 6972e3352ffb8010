"""What a training step holds in memory on this rank, measured by kind (parameters,
gradients, optimizer state, activations), to hold beside ZeRO's formula
(`cost.zero_memory`); and activation recomputation (`recompute`), which trades that
memory for compute.

Bytes are counted per storage, each storage once: a parameter that is a view into a flat
buffer counts the buffer, a master shard that shares it counts nothing more. Activations
are what autograd saves for backward (inputs of each layer, outputs of its nonlinearity),
tracked from the moment a tensor is saved until the graph lets it go; parameters saved by
autograd are counted as parameters, not twice. Under recomputation they also include what
a unit's forward rebuilds during backward, for as long as it stays alive.

With a `budget` (bytes) the tracker stands for a device of that size: a sample above it
raises `BudgetExceeded`, one line naming the budget, what was held and what to change.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

KINDS = ("parameters", "gradients", "optimizer", "activations")


class BudgetExceeded(MemoryError):
    """A MemoryTracker sampled more bytes than its device budget allows."""


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


@dataclass
class MemorySample:
    """Bytes this rank held, by kind, at one point of a step."""

    label: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


def _storage(t: torch.Tensor) -> tuple[int, int]:
    if isinstance(t, DTensor):  # torch's FSDP2 shards: count this rank's local piece
        t = t.to_local()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _count(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        ptr, nbytes = _storage(t)
        if ptr not in seen and nbytes:
            seen.add(ptr)
            total += nbytes
    return total


class MemoryTracker:
    """Samples what `module`, its ZeRO `shards` (FlatShards) and `optimizer` hold on this
    rank. A shard's master slice counts as parameters when it is in the parameters' dtype
    (it is this rank's copy of them) and as optimizer state when it is a float32 master of
    16-bit parameters (mixed precision, as ZeRO's 12 bytes per parameter count it).

    Inside `watch()` it samples after every top-level child's forward and after every
    parameter's gradient is accumulated, so `samples` draws the curve of one step; call
    `sample(label)` for any other point (after `step()`, say). With `budget` (bytes: the
    device's size) every sample checks it and raises `BudgetExceeded` above it."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 shards: Iterable = (), budget: int | None = None) -> None:
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be None (no limit) or a positive int of bytes; "
                             f"got {budget!r}")
        self.module, self.optimizer, self.shards = module, optimizer, list(shards)
        self.budget = budget
        self.samples: list[MemorySample] = []
        self._saved: weakref.WeakSet[_Saved] = weakref.WeakSet()  # alive while autograd holds
        # alive while they live; keyed by id: a WeakSet would compare two tensors with ==
        # when the same one is kept twice (one input fed to every step)
        self._kept: weakref.WeakValueDictionary[int, torch.Tensor] = \
            weakref.WeakValueDictionary()
        # storages a recomputation rebuilt: alive while anything (autograd's checkpoint
        # frame, say) still uses them
        self._rebuilt: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def sample(self, label: str) -> MemorySample:
        seen: set[int] = set()
        params = list(self.module.parameters())
        masters = [s.master for s in self.shards if s.master.dtype == s.dtype]
        mixed = [s.master for s in self.shards if s.master.dtype != s.dtype]
        parameters = _count(params + masters, seen)
        gradients = _count([p.grad for p in params + masters + mixed]
                           + [s.grad for s in self.shards], seen)
        state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]
        optimizer = _count(mixed + state, seen)
        # where each saved tensor's storage is *now*: FSDP may have shrunk or refilled it
        activations = _count([s.tensor for s in self._saved] + list(self._kept.values()), seen)
        for storage in list(self._rebuilt):
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                activations += storage.nbytes()
        result = MemorySample(label, parameters, gradients, optimizer, activations)
        self.samples.append(result)
        if self.budget is not None and result.total > self.budget:
            raise BudgetExceeded(
                f"device budget {mib(self.budget)} exceeded at {label!r}: held "
                f"{mib(result.total)} (parameters {mib(parameters)}, gradients "
                f"{mib(gradients)}, optimizer {mib(optimizer)}, activations {mib(activations)}); "
                "raise budget= or offload/recompute more layers (minipar.sharded.Offload)")
        return result

    def track_saved(self, box: object) -> None:
        """Count `box.tensor` (None: nothing on the device now) as an activation for as long
        as autograd holds `box`: how an offloader's saved-tensor hooks report what they keep."""
        self._saved.add(box)

    def _pack(self, t: torch.Tensor) -> _Saved:
        saved = _Saved(t)
        if not isinstance(t, nn.Parameter):  # a parameter counts as one, not as activation
            self._saved.add(saved)
        return saved

    def keep(self, t: torch.Tensor) -> None:
        """Count `t` as an activation for as long as it lives (what recomputation keeps)."""
        self._kept[id(t)] = t

    def rebuilt(self, t: torch.Tensor) -> None:
        """Count `t`'s storage as an activation for as long as the storage lives: a tensor
        a recomputation made in backward. Checkpoint keeps only detached views of what it
        rebuilds, so the storage, not the tensor object, tells whether it is still held."""
        self._rebuilt.add(t.untyped_storage())

    @contextmanager
    def watch(self) -> Iterator[MemoryTracker]:
        """Track activations and sample through forward and backward inside the block."""
        def after(label: str):  # a hook that returns None, so the output is left alone
            return lambda *_: None if self.sample(label) else None

        handles = [child.register_forward_hook(after(f"forward {name}"))
                   for name, child in self.module.named_children()]
        handles += [p.register_post_accumulate_grad_hook(after("backward"))
                    for p in self.module.parameters() if p.requires_grad]
        _watching.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack):
                yield self
        finally:
            _watching.remove(self)
            for handle in handles:
                handle.remove()

    def peak(self) -> MemorySample:
        """The sample with the largest total."""
        if not self.samples:
            raise ValueError("no samples yet: call sample() or run a step inside watch()")
        return max(self.samples, key=lambda s: s.total)


_watching: list[MemoryTracker] = []  # trackers inside watch(): recompute() reports to them


def recompute(units: Iterable[nn.Module]) -> None:
    """Activation recomputation (gradient checkpointing) per unit: in forward a unit keeps
    only its input; in backward it runs its forward again to rebuild what its backward
    needs (torch.utils.checkpoint, non-reentrant). Activation memory falls from every
    layer's saved tensors to one input per unit, plus, during backward, the one unit being
    rebuilt, for about one extra forward of compute. A `MemoryTracker` sees both: the
    inputs kept, and every tensor the rebuilt forward makes, while it stays alive."""
    for unit in units:
        def checkpointed(*args, _forward=unit.forward, **kwargs):
            for tracker in _watching:  # the input stays alive until backward: count it
                for a in args:
                    if isinstance(a, torch.Tensor):
                        tracker.keep(a)
            contexts = (nullcontext(), _Rebuilding(list(_watching))) if _watching else \
                (nullcontext(), nullcontext())
            return checkpoint(_forward, *args, use_reentrant=False,
                              context_fn=lambda: contexts, **kwargs)

        unit.forward = checkpointed


class _Rebuilding(TorchDispatchMode):
    """Around a unit's recomputation in backward: hands every tensor an operation makes to
    the trackers, which hold it weakly. What checkpoint keeps for the unit's backward stays
    counted until that backward frees it; temporaries drop out as soon as they die."""

    def __init__(self, trackers: list[MemoryTracker]) -> None:
        super().__init__()
        self.trackers = trackers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for tracker in self.trackers:
                    tracker.rebuilt(t)
        return out


class _Saved:
    """A tensor autograd saved for backward. Autograd holds this box until it no longer
    needs the tensor; the tracker only holds it weakly, so it stops counting then."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor
