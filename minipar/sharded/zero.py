"""ZeRO stages 1 and 2: data parallelism that shards what every rank would otherwise keep
a copy of (Rajbhandari et al. 2020).

Plain data parallelism keeps on every rank the parameters, the gradients and the
optimizer state (Adam's two moments, and fp32 master weights in mixed precision): 16
bytes per parameter, K times over. ZeRO splits a flat view of the parameters into K
slices and gives rank r slice r:

- stage 1 shards the optimizer state: after backward the ranks reduce-scatter the
  gradients (rank r receives the average of slice r), each rank updates only its slice
  with its own optimizer, and an all-gather brings every rank the updated parameters;
- stage 2 also shards the gradients: each bucket of gradients is reduce-scattered as
  soon as backward has produced it, and the full gradients are freed at once.

A reduce-scatter plus an all-gather move exactly what a ring all-reduce moves, so both
stages cost data parallelism's 2(K-1)/K x parameters per rank and step. Stage 3 (the
parameters too) is `fsdp.py`. Loss scaling follows `ddp.py`: gradients are averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .. import collectives
from ..collectives.background import CommThread, used_by_submitter
from ..data_parallel import bucket_parameters
from ..runtime import rank, world_size
from ..trace import record

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer updates: requires_grad, each shared (tied) one once."""
    return [p for p in module.parameters() if p.requires_grad]


class FlatShard:
    """Some parameters seen as one flat vector, padded with zeros to a multiple of K and cut
    into K equal slices; this rank keeps slice `rank` as `master`, the tensor its optimizer
    updates.

    The parameters become views into one flat buffer (`flat`). With `keep_full` (stages 1
    and 2), in one precision, `master` is a view of this rank's slice of it: the optimizer
    updates the parameters in place and nothing is stored twice. Without it (stage 3)
    `master` is a copy, the only one this rank keeps, so that `flat` can be emptied between
    uses and gathered again. With `param_dtype` (mixed precision, e.g. torch.bfloat16) the
    parameters, their gradients and what travels are in that dtype, while `master` keeps
    the parameters' original (float32) precision for the optimizer.

    It also counts the gradients backward still owes (`arrived`), so that a trainer can
    reduce-scatter the shard as soon as they are all there.

    `replicate` (HSDP, hybrid sharding): the ranks that hold the same slice in other groups
    of the same layout; the gradient reduce-scattered inside `group` is then averaged
    across them too, while gathering stays inside `group`.
    """

    def __init__(self, params: list[nn.Parameter], keep_full: bool = True,
                 param_dtype: torch.dtype | None = None, group=None, replicate=None) -> None:
        if not params:
            raise ValueError("a FlatShard needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"parameters sharded together must share one dtype; got {dtypes}")
        self.params = params
        self.shapes = [p.shape for p in params]  # kept: stage 3 empties the parameters
        self.numel = sum(p.numel() for p in params)
        self.group, self.world, self.rank = group, world_size(group), rank(group)
        self.replicate = replicate if replicate is not None and world_size(replicate) > 1 \
            else None
        # ZeRO's padding: round up so all K slices have one length, as all-gather and
        # reduce-scatter of equal pieces need; flatten() pads the tail with zeros
        self.slice = math.ceil(self.numel / self.world)  # padded length / K
        # detach: the flat copy of the values must not join the autograd graph
        full = self.flatten([p.detach() for p in params])
        self.dtype = param_dtype or full.dtype  # what the model computes and sends in
        mine = full[self.rank * self.slice:(self.rank + 1) * self.slice]
        same = self.dtype == full.dtype
        # clone for stage 3 (flat is emptied between uses) or when master keeps a wider dtype
        self.master = nn.Parameter(mine if same and keep_full else mine.clone())
        self.grad: torch.Tensor | None = None  # this rank's averaged gradient slice
        self.waiting = len(params)  # gradients backward has still to produce
        self.flat = full if same else full.to(self.dtype)
        for p, piece in zip(params, self.pieces(self.flat), strict=True):
            # .data, not a new Parameter: the module and any optimizer keep the same Parameter
            # objects, which now read and write the flat buffer
            p.data = piece

    def flatten(self, tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """One padded flat vector (None counts as zeros: a parameter that got no gradient)."""
        like = self.params[0]
        pieces = [torch.zeros(shape.numel(), dtype=like.dtype, device=like.device)
                  if t is None else t.reshape(-1).to(like.dtype)
                  for shape, t in zip(self.shapes, tensors, strict=True)]
        # the padding zeros: they carry no parameter, and their gradient is zero too
        pad = self.slice * self.world - self.numel
        if pad:
            pieces.append(torch.zeros(pad, dtype=like.dtype, device=like.device))
        return torch.cat(pieces)

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (padded) cut back into tensors shaped like the parameters."""
        out, start = [], 0
        for shape in self.shapes:
            out.append(flat[start:start + shape.numel()].view(shape))
            start += shape.numel()
        return out

    def arrived(self) -> bool:
        """One more parameter's gradient is complete; True if it was the last one owed."""
        self.waiting -= 1
        return self.waiting == 0

    def take_gradients(self) -> torch.Tensor:
        """The parameters' gradients as one padded flat vector, dropped from the parameters
        (only this rank's slice will survive); the count of gradients owed starts over."""
        flat = self.flatten(p.grad for p in self.params)
        for p in self.params:
            # full gradients freed now: only this rank's reduced slice is kept (ZeRO-2's saving)
            p.grad = None
        self.waiting = len(self.params)
        return flat

    def unsent(self) -> bool:
        """Does the step still have to reduce-scatter this shard? Yes if nothing was sent
        (parameters with no gradient send zeros, so every rank joins in) or a later
        backward left gradients behind."""
        return self.grad is None or any(p.grad is not None for p in self.params)

    def reduce_scatter_gradients(self, flat: torch.Tensor) -> None:
        """Average `flat` (from take_gradients) over ranks; keep only this rank's slice (in
        `grad`, in the parameters' dtype, added to what an earlier backward left)."""
        # avg: gradients are averaged over ranks, the package's loss-scaling convention (ddp.py)
        mine = collectives.reduce_scatter(flat, op="avg", group=self.group)
        if self.replicate is not None:
            # HSDP: the groups are alike, so the average of their averages is everyone's
            collectives.all_reduce(mine, op="avg", group=self.replicate)
        self.grad = mine if self.grad is None else self.grad + mine
        # on a communication thread's stream, kept for the optimizer on the compute stream
        used_by_submitter(self.grad)

    def hand_gradient_to_optimizer(self) -> None:
        """Move the reduced slice into master.grad, in the master's precision; a partial
        count of gradients owed starts over."""
        # the optimizer steps in the master precision (float32 under mixed precision)
        self.master.grad, self.grad = self.grad.to(self.master.dtype), None
        self.waiting = len(self.params)

    def gather(self) -> torch.Tensor:
        """All ranks' updated slices, concatenated: the full flat parameters (padded), in
        the parameters' dtype (mixed precision sends 16-bit values)."""
        # detach: the gathered values are data, not part of any graph
        return collectives.all_gather(self.master.detach().to(self.dtype), group=self.group)


def _check_param_dtype(param_dtype: torch.dtype | None) -> torch.dtype | None:
    if param_dtype not in (None, torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError("param_dtype must be None (train in the parameters' dtype) or one of "
                         f"torch.bfloat16, torch.float16, torch.float32, torch.float64; got "
                         f"{param_dtype!r}")
    return param_dtype


def cast_inputs(args: tuple, dtype: torch.dtype | None) -> tuple:
    """Floating-point tensor arguments in the dtype the model computes in (mixed precision)."""
    if dtype is None:
        return args
    # floating inputs only: integer ones (token ids, labels) stay as they are
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


class ZeroDataParallel:
    """Train `module` with ZeRO stage 1 or 2 over all ranks (or the ranks of `group`: the
    data-parallel dimension of a mesh).

    Call `loss.backward()` as usual, then `step()`: it reduce-scatters what backward has not
    already sent (stage 1: everything), steps this rank's optimizer on its slices and
    all-gathers the parameters. `optimizer` builds the optimizer from a list of parameters
    (e.g. `lambda ps: torch.optim.Adam(ps, lr=1e-3)`); it only ever sees this rank's slices,
    so its state is 1/K of data parallelism's. Every rank must start from the same weights.
    `param_dtype=torch.bfloat16` trains in mixed precision: the model computes, and the
    gradients travel, in bf16, while the optimizer updates float32 master slices.
    `buckets` gives the parameters' groups (each one flat shard) instead of cutting them
    by `bucket_bytes`: a composition that must lay one parameter out alike on two ranks
    holding different modules (a tied weight at both ends of a pipeline) gives it a
    shard of its own.

    Under `no_sync()` stage 2 accumulates full gradients and sends nothing: gradients are
    reduced once per optimizer step, in the backward of its last micro-batch.
    `replicate`: HSDP's other groups (FlatShard). `comm`: a `CommThread` on which stage 2
    runs each bucket's reduce-scatter while backward goes on computing (otherwise the
    hook runs it and backward waits); wrappers that share a group share one thread, so
    their collectives keep one order on every rank.
    """

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, stage: int = 1,
                 bucket_bytes: int = 1 << 20, param_dtype: torch.dtype | None = None,
                 group=None, buckets: list[list[nn.Parameter]] | None = None,
                 replicate=None, comm: CommThread | None = None) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (stage 3 is FullyShardedDataParallel); "
                             f"got {stage!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int; got {bucket_bytes!r}")
        params = trainable_parameters(module)
        if not params:
            raise ValueError("module has no parameter with requires_grad=True to train")
        self.module, self.stage = module, stage
        # backward produces gradients from the last layer to the first: bucket in that order
        self.param_dtype = _check_param_dtype(param_dtype)
        if buckets is None:
            buckets = bucket_parameters(params[::-1], bucket_bytes)
        elif sorted(map(id, params)) != sorted(id(p) for b in buckets for p in b):
            raise ValueError("buckets must hold every trainable parameter of the module once")
        self.shards = [FlatShard(b, param_dtype=param_dtype, group=group, replicate=replicate)
                       for b in buckets]
        self.optimizer = optimizer([s.master for s in self.shards])
        self._sync, self.comm = True, comm
        if stage == 2:
            for shard in self.shards:
                for p in shard.params:
                    # s=shard binds this shard now (a plain closure would see the loop's last one)
                    p.register_post_accumulate_grad_hook(lambda _p, s=shard: self._arrived(s))

    def __call__(self, *args, **kwargs):
        return self.module(*cast_inputs(args, self.param_dtype), **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full gradients locally (stage 2 holds its reduce-scatter); the next
        synchronized backward, or `reduce_gradients`, sends the accumulated sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _arrived(self, shard: FlatShard) -> None:
        """Stage 2: when a bucket's last gradient is complete, send it at once."""
        if self._sync and shard.arrived():
            self._send(shard, background=True)

    def _send(self, shard: FlatShard, background: bool = False) -> None:
        # the full gradients are taken here, on the caller's thread (backward's, in a hook)
        flat = shard.take_gradients()
        if background and self.comm is not None:
            # the moment backward hands the bucket over (it runs when the thread gets to it)
            with record("queue", f"queue reduce-scatter bucket {self.shards.index(shard)}"):
                self.comm.submit(self._reduce, shard, flat)
        else:
            self._reduce(shard, flat)

    def _reduce(self, shard: FlatShard, flat: torch.Tensor) -> None:
        with record("reduce_scatter", f"reduce-scatter bucket {self.shards.index(shard)}"):
            shard.reduce_scatter_gradients(flat)

    def step(self) -> None:
        """Finish the gradient exchange, update this rank's slices, gather the parameters."""
        self.reduce_gradients()
        self.update()

    def reduce_gradients(self) -> None:
        """The first half of `step`: every slice's averaged gradient in its master's .grad
        (where a trainer may clip them, by a norm summed over the ranks' slices)."""
        if self.comm is not None:
            self.comm.join()  # every reduce-scatter backward started has landed
        for shard in self.shards:
            if shard.unsent():  # stage 1, or gradients a backward left behind
                self._send(shard)
            shard.hand_gradient_to_optimizer()

    def update(self) -> None:
        """The second half of `step`: update this rank's slices, gather the parameters."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no zero-filled gradients kept between steps
        self.gather_parameters()

    def gather_parameters(self) -> None:
        """Every parameter whole again from the ranks' slices (after a step, or after the
        slices were loaded from a checkpoint); a collective: call it on all ranks."""
        with torch.no_grad():
            for shard in self.shards:
                shard.flat.copy_(shard.gather())  # the parameters are views of flat
