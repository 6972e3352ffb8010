"""Data parallelism inside the pipeline: the lessons' own wrappers (lesson 02's
`DataParallel`, lesson 06's `ZeroDataParallel` and `FullyShardedDataParallel`) over each
pipeline stage a rank holds, reducing while the pipeline's backward runs.

A stage's backward adds into .grad (pipeline/stage.py), so the wrappers' hooks fire in it.
There is one wrapper per stage (per model chunk, as Megatron-LM keeps one DDP per virtual
stage), and the engine runs every backward of a stage under that stage's `no_sync`
except its last one in the optimizer step (`Pipeline.reduce_gradients_with`):

- zero 0: DDP's buckets are all-reduced during the last micro-batch's backward;
- zero 1: the reduce-scatter waits for `reduce_gradients`, after backward;
- zero 2: each bucket is reduce-scattered as soon as the last micro-batch completes it,
  on one communication thread while backward goes on (`hidden_and_exposed` measures
  how much of it the compute hides);
- zero 3: each unit (a block) is gathered for its forward and again for its backward,
  and reduce-scattered in every micro-batch's backward (fsdp.py says why), all on the
  communication thread, which gathers the next unit while this one computes (FSDP2's
  prefetch, as torchtitan runs it).

Parameters whose replicas span different ranks travel in separate wrappers: `groups`
maps a parameter to the group of its replicas (a mixture's experts are replicated over
dp only, the dense weights over dp and ep), the rest use `group`. With `replicate`
(HSDP), ZeRO shards inside `group` and averages each slice across `replicate`, the
ranks holding the same slice in the other groups.

The tied weight at the two ends of a pipeline: each end reduces its own copy over dp,
then the two reduced gradients are summed (`MeshModel.sum_tied_gradients`), which equals
summing first, since both are linear. Under ZeRO both ends must then slice that weight
alike, so it gets a shard of its own on both (a bucket alone for ZeRO-1/2, the root unit
alone for ZeRO-3), whatever else each end holds; `tied_holder` is the tensor whose .grad
holds its reduced gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.background import CommThread
from ..data_parallel import DataParallel, bucket_parameters
from ..runtime import world_size
from ..sharded import FlatShard, FullyShardedDataParallel, ZeroDataParallel
from ..sharded.zero import OptimizerFactory, trainable_parameters
from ..trace import Event, overlap_length, subtract, union_length

Wrapper = DataParallel | ZeroDataParallel | FullyShardedDataParallel
# the labels of the events each wrapper records for its reductions over dp
REDUCTIONS = ("bucket ", "reduce-scatter bucket ", "reduce-scatter unit ")


def hidden_and_exposed(events: list[Event]) -> tuple[float, float]:
    """One rank's data-parallel reductions in a step, split into the seconds hidden under
    compute and the seconds exposed. Compute is the main thread's F, B and W actions, less
    the time the main thread itself spends in a reduction (a reduce-scatter run inside a
    hook pauses the backward: it is exposed even though it happens during backward); a
    reduction on a communication thread (DDP's buckets) is hidden where it overlaps that
    compute."""
    reductions = [(e.start, e.end) for e in events if e.label.startswith(REDUCTIONS)]
    blocking = [(e.start, e.end) for e in events
                if e.label.startswith(REDUCTIONS) and e.thread == 0]
    compute = subtract([(e.start, e.end) for e in events
                        if e.kind in ("F", "B", "W") and e.thread == 0], blocking)
    hidden = overlap_length(reductions, compute)
    return hidden, union_length(reductions) - hidden


class ChainedOptimizer:
    """Several optimizers stepped as one (one per stage's ZeRO wrapper; Megatron-LM's
    ChainedOptimizer): their parameter groups and state seen together, in order."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        """Each parameter's state dict, the owner's own object (writing it writes there)."""
        return {p: o.state[p] for o in self.optimizers for g in o.param_groups
                for p in g["params"]}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def _holds(module: nn.Module, p: nn.Parameter | None) -> bool:
    return p is not None and any(q is p for q in module.parameters())


def fsdp_units(stage: nn.Module, tied: nn.Parameter | None) -> list[nn.Module]:
    """ZeRO-3's units on one stage: each layer, except that a layer holding the tied weight
    gives its other children instead, so the tied weight is always the root alone."""
    units = []
    for layer in stage.children():
        parts = [c for c in layer.children() if not _holds(c, tied)] if _holds(layer, tied) \
            else [layer]
        units += [u for u in parts if any(True for _ in u.parameters())]
    return units


class StageDataParallel:
    """Data parallelism (`zero` 0-3) over each of this rank's pipeline stages (`stages`:
    stage index -> module), over `group` (or, per parameter, `groups[id(p)]`). Built
    before the pipeline, since ZeRO makes parameters views of its flat buffers.
    `optimizer` builds each ZeRO wrapper's optimizer (zero 0: the caller builds one)."""

    def __init__(self, stages: dict[int, nn.Module], zero: int, optimizer: OptimizerFactory,
                 group: dist.ProcessGroup, tied: nn.Parameter | None = None,
                 groups: dict[int, dist.ProcessGroup] | None = None,
                 replicate: dist.ProcessGroup | None = None) -> None:
        groups = groups or {}
        if zero == 3 and groups:
            raise ValueError("zero=3 with experts over ep is not built: FSDP gathers whole "
                             "blocks, whose experts are replicated over fewer ranks than "
                             "their dense weights; use zero 0, 1 or 2 with ep > 1")
        self.zero, self.tied, self.replicate = zero, tied, replicate
        # DDP's all-reduces, ZeRO-2's reduce-scatters or ZeRO-3's gathers and reduce-scatters,
        # every stage's, on one thread: the stages' wrappers share a group, whose collectives
        # must come in one order
        self.comm = CommThread("minipar-dp-comm") if zero in (0, 2, 3) else None
        self.wrappers: dict[int, list[Wrapper]] = {}
        for index, module in stages.items():
            parts: dict[int, tuple[dist.ProcessGroup, list[nn.Parameter]]] = {}
            for p in trainable_parameters(module):
                g = groups.get(id(p), group)
                parts.setdefault(id(g), (g, []))[1].append(p)
            self.wrappers[index] = [self._wrap(module, g, ps, optimizer, len(parts) == 1)
                                    for g, ps in parts.values()
                                    if zero or world_size(g) > 1]
        everyone = [w for ws in self.wrappers.values() for w in ws]
        self.sharded = [w for w in everyone if not isinstance(w, DataParallel)]
        self.optimizer = (None if not self.sharded else self.sharded[0].optimizer
                          if len(self.sharded) == 1
                          else ChainedOptimizer([w.optimizer for w in self.sharded]))

    def _wrap(self, module: nn.Module, group: dist.ProcessGroup, params: list[nn.Parameter],
              optimizer: OptimizerFactory, whole: bool) -> Wrapper:
        # a wrapper takes a module: a subset of the stage's parameters comes as a list module
        holder = module if whole else nn.ParameterList(params)
        if self.zero == 0:
            return DataParallel(holder, group=group, comm=self.comm)
        if self.zero == 3:
            return FullyShardedDataParallel(module, optimizer, fsdp_units(module, self.tied),
                                            group=group, replicate=self.replicate,
                                            comm=self.comm)
        rest = [p for p in params if p is not self.tied]
        # backward produces gradients from the last layer to the first: bucket in that order
        buckets = bucket_parameters(rest[::-1], 1 << 20) + \
            ([[self.tied]] if len(rest) < len(params) else [])
        return ZeroDataParallel(holder, optimizer, self.zero, group=group, buckets=buckets,
                                replicate=self.replicate, comm=self.comm)

    @contextmanager
    def no_sync(self, stage: int) -> Iterator[None]:
        """Backward of `stage` accumulates without reducing (every wrapper of the stage)."""
        with ExitStack() as stack:
            for wrapper in self.wrappers.get(stage, []):
                stack.enter_context(wrapper.no_sync())
            yield

    @property
    def shards(self) -> list[FlatShard]:
        """Every ZeRO slice this rank keeps, in the optimizer's order."""
        return [s for w in self.sharded for s in w.shards]

    def reduce_gradients(self) -> None:
        """What backward left unreduced (ZeRO-1: everything) reduced; every ZeRO slice's
        averaged gradient in its master's .grad (DDP's are in .grad already)."""
        for wrapper in self.sharded:
            wrapper.reduce_gradients()

    def update(self) -> None:
        """Each ZeRO wrapper's step on its slices, then its parameters gathered (ZeRO-1/2;
        ZeRO-3 gathers at the next forward)."""
        for wrapper in self.sharded:
            wrapper.update()

    def tied_holder(self) -> nn.Parameter | None:
        """The tensor whose .grad is the tied weight's reduced gradient on this rank: the
        weight itself (zero 0) or the master of the shard that holds it alone."""
        if self.tied is None or self.zero == 0:
            return self.tied
        return next((s.master for s in self.shards
                     if len(s.params) == 1 and s.params[0] is self.tied), None)

    def gather_parameters(self) -> None:
        """Every parameter whole from the slices (a collective over the groups): ZeRO-1/2
        after slices were loaded, ZeRO-3 to read the whole model."""
        for wrapper in self.sharded:
            wrapper.gather_parameters()
