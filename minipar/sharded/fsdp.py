"""ZeRO stage 3 / FSDP: the parameters are sharded too (Rajbhandari et al. 2020; Zhao et
al. 2023, PyTorch FSDP).

The model is cut into units (by default its top-level children: the layers or blocks).
Each unit's parameters live as one flat vector of which rank r keeps slice r; the full
parameters exist only while the unit computes:

    forward:  all-gather the unit -> compute -> free the full parameters
    backward: all-gather the unit again -> compute -> reduce-scatter its gradients -> free

so a rank holds its 1/K of everything plus one or two units in full. The price is a
third collective: two all-gathers and a reduce-scatter of the parameters per step, 1.5x
what data parallelism or ZeRO-1/2 send. Parameters outside every unit, or shared by two
units (tied weights), form the root unit, gathered for the whole step. Frozen parameters
(requires_grad=False) are not sharded: every rank keeps them whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import torch
from torch import nn

from ..collectives.background import CommThread
from ..trace import record
from .zero import (
    FlatShard,
    OptimizerFactory,
    _check_param_dtype,
    cast_inputs,
    trainable_parameters,
)


def default_units(module: nn.Module) -> list[nn.Module]:
    """The top-level children that hold parameters: one unit per layer or block."""
    return [child for child in module.children() if any(True for _ in child.parameters())]


class _Unit:
    """One sharded unit: its FlatShard (whose flat buffer the parameters are views of),
    whether that buffer is full now, and a prefetched gather on its way.

    Freeing shrinks the buffer's storage to nothing instead of pointing the parameters
    elsewhere: autograd may have saved views of the weights for backward (a linear layer
    saves its weight transposed), and those views must lose their memory too, then see the
    values again when backward gathers the unit."""

    def __init__(self, shard: FlatShard, index: int) -> None:
        self.shard, self.index = shard, index
        # the full size, to resize the storage back to when the unit is gathered again
        self.nbytes = shard.flat.untyped_storage().nbytes()
        self.gathered = True
        self.pending: Future | None = None  # a prefetched all-gather not yet installed

    def fetch(self) -> torch.Tensor:
        """The all-gather itself (on the main thread, or the prefetching CommThread)."""
        with record("all_gather", f"gather unit {self.index}", stage=self.index):
            return self.shard.gather()

    def gather(self, comm: CommThread | None = None) -> None:
        """Make the parameters whole: wait for a prefetched gather, or gather now."""
        if self.gathered:
            return
        if self.pending is not None:
            gathered, self.pending = self.pending.result(), None
        elif comm is not None:  # keep the collective order: through the thread
            gathered = comm.submit(self.fetch).result()
        else:
            gathered = self.fetch()
        # the storage regrows in place: every view of it (parameters, autograd's saved tensors)
        # sees the new memory
        self.shard.flat.untyped_storage().resize_(self.nbytes)
        # .data: a refill that autograd's saved views must not count as a modification
        self.shard.flat.data.copy_(gathered)
        self.gathered = True

    def prefetch(self, comm: CommThread) -> None:
        """Start this unit's all-gather in the background, if it is not whole or coming."""
        if not self.gathered and self.pending is None:
            self.pending = comm.submit(self.fetch)

    def free(self) -> None:
        # free the memory but keep the tensor objects and their views: see the class docstring
        self.shard.flat.untyped_storage().resize_(0)
        self.gathered = False

    def send_gradients(self, comm: CommThread | None = None) -> None:
        """Reduce-scatter the unit's gradients (in the background with `comm`) and drop the
        full ones; the slice adds up in shard.grad."""
        flat = self.shard.take_gradients()
        if comm is None:
            self._reduce(flat)
        else:
            # the moment backward hands the unit over (it runs when the thread gets to it)
            with record("queue", f"queue reduce-scatter unit {self.index}", stage=self.index):
                comm.submit(self._reduce, flat)

    def _reduce(self, flat: torch.Tensor) -> None:
        with record("reduce_scatter", f"reduce-scatter unit {self.index}", stage=self.index):
            self.shard.reduce_scatter_gradients(flat)


class FullyShardedDataParallel:
    """Train `module` with its parameters, gradients and optimizer state sharded over all
    ranks (ZeRO-3). Use it like the module: `fsdp(x)`, `loss.backward()`, `fsdp.step()`.
    `units` are the modules gathered one at a time (default: `default_units(module)`);
    each must run once per forward. `optimizer` builds the optimizer from this rank's
    slices. `gather_parameters()` makes every parameter whole again (to read or save).
    `param_dtype=torch.bfloat16`: mixed precision as in ZeroDataParallel; no 16-bit shard is
    kept at rest, the float32 master slice is cast when gathered (as FSDP2 does).
    `prefetch=True` runs every collective on a background thread and starts gathering the
    next unit (forward: the one after, backward: the one before) while this one computes;
    `comm` is that thread, when wrappers over one group share it (their collectives must
    keep one order: a pipeline rank's stages) and implies prefetch.
    `group`: the ranks that share the shards (a mesh's data-parallel dimension; default
    every rank); `replicate`: HSDP's other groups holding the same shards (FlatShard).

    A unit's gradients are reduce-scattered in every backward that completes them, each
    micro-batch of an accumulation included (`no_sync` holds nothing): keeping whole
    gradients until the last one would cost ZeRO-2's gradient memory, and ZeRO-3 pays
    one more reduce-scatter per micro-batch instead, as FSDP does by default."""

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory,
                 units: Iterable[nn.Module] | None = None,
                 param_dtype: torch.dtype | None = None, prefetch: bool = False,
                 group=None, replicate=None, comm: CommThread | None = None) -> None:
        if not trainable_parameters(module):
            raise ValueError("module has no parameter with requires_grad=True to train")
        self.param_dtype = _check_param_dtype(param_dtype)
        self.comm = comm if comm is not None else \
            CommThread("minipar-fsdp-comm") if prefetch else None
        units = default_units(module) if units is None else list(units)
        owners = Counter(id(p) for u in units for p in trainable_parameters(u))
        assigned: set[int] = set()
        self.module, self.units = module, []
        for unit_module in units:
            own = [p for p in trainable_parameters(unit_module)
                   if owners[id(p)] == 1 and id(p) not in assigned]
            assigned |= {id(p) for p in own}
            if own:
                # keep_full=False: at rest a rank keeps only its slice (ZeRO-3)
                unit = _Unit(FlatShard(own, False, param_dtype, group, replicate),
                             len(self.units))
                self.units.append(unit)
                # gather before the unit's forward; i=unit.index binds this unit, not the loop's
                # last
                unit_module.register_forward_pre_hook(
                    lambda _m, _a, i=unit.index: self._before(i, +1))
                unit_module.register_forward_hook(
                    lambda _m, _a, out, u=unit: self._after_forward(u, out))
        rest = [p for p in trainable_parameters(module) if id(p) not in assigned]
        self.root = (_Unit(FlatShard(rest, False, param_dtype, group, replicate),
                           len(self.units)) if rest else None)
        if self.root is not None:
            # the root unit (tied or unassigned parameters) is gathered for the whole step
            module.register_forward_pre_hook(lambda _m, _a: self.root.gather(self.comm))
        for unit in self._all_units():
            unit.free()
            for p in unit.shard.params:
                p.register_post_accumulate_grad_hook(lambda _p, u=unit: self._arrived(u))
        self.optimizer = optimizer([u.shard.master for u in self._all_units()])

    def _all_units(self) -> list[_Unit]:
        return self.units + ([self.root] if self.root is not None else [])

    @property
    def shards(self) -> list[FlatShard]:
        """Every unit's FlatShard (the root's last): what this rank keeps."""
        return [u.shard for u in self._all_units()]

    def __call__(self, *args, **kwargs):
        return self.module(*cast_inputs(args, self.param_dtype), **kwargs)

    def _after_forward(self, unit: _Unit, output: object) -> None:
        """Free the unit; if backward will come through it, gather it again just before."""
        unit.free()
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # a hook on the unit's output fires when backward reaches it, just before the unit's
                # own backward: the moment to gather its parameters again
                t.register_hook(lambda _grad, i=unit.index: self._before(i, -1))

    def _before(self, i: int, direction: int) -> None:
        """Unit i is about to compute (direction +1: forward, -1: backward): make it whole,
        and with prefetch start gathering the unit that computes after it."""
        self.units[i].gather(self.comm)
        following = i + direction
        if self.comm is not None and 0 <= following < len(self.units):
            # the next unit to compute: i + 1 in forward, i - 1 in backward
            self.units[following].prefetch(self.comm)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing is held: ZeRO-3 reduce-scatters every micro-batch (class docstring)."""
        yield

    def _arrived(self, unit: _Unit) -> None:
        if unit.shard.arrived():
            unit.send_gradients(self.comm)
            if unit is not self.root:  # the root stays whole for the step: later
                unit.free()            # micro-batches may still go back through it

    def step(self) -> None:
        """Finish the gradient exchange (units that got no gradient send zeros) and update
        this rank's slices; the next forward gathers the new parameters."""
        self.reduce_gradients()
        self.update()

    def reduce_gradients(self) -> None:
        """The first half of `step`: every slice's averaged gradient in its master's .grad
        (where a trainer may clip them, by a norm summed over the ranks' slices)."""
        if self.comm is not None:
            self.comm.join()  # every background gather and reduce-scatter has landed
        for unit in self._all_units():
            if unit.shard.unsent():
                unit.send_gradients()
            unit.shard.hand_gradient_to_optimizer()
            unit.free()
            # a gather prefetched for a unit that then did not compute (recomputation's forward
            # inside backward prefetches the unit after it) holds the weights the update is
            # about to change: the next forward gathers afresh
            unit.pending = None

    def update(self) -> None:
        """The second half of `step`: update this rank's slices."""
        self.optimizer.step()
        # set_to_none: no zero-filled gradient tensors are kept between steps
        self.optimizer.zero_grad(set_to_none=True)

    def gather_parameters(self) -> None:
        """Every parameter whole on every rank (a collective: call it on all ranks)."""
        for unit in self._all_units():
            unit.gather(self.comm)
