"""Data parallelism from scratch: the same model on every rank, different samples.

Two ways to combine the ranks' gradients, both on minipar's own collectives:

- `DataParallel`: every rank keeps a full replica and the ranks all-reduce
  gradients, one parameter at a time or in buckets, optionally overlapped with
  the backward pass (what torch's DDP does, in a file you can read).
- the parameter server (`parameter_server.py`): one or more server ranks hold
  the weights; workers pull them, compute, and push gradients back.

The loss-scaling convention (one for the whole package): gradients are averaged
over ranks. A global batch is split with torch.tensor_split, so when it does not
divide evenly the first B mod K ranks get one sample more; each rank then multiplies
its mean loss by `shard_weight` = K x local / global, so that every sample counts
exactly once and the averaged gradient equals the single-process gradient of the
mean loss over the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from .. import collectives
from ..collectives.background import CommThread
from ..runtime import rank, world_size
from ..trace import record

FIRST_BUCKET_BYTES = 1 << 20  # as torch's DDP: a small first bucket starts communication early


def shard(batch: torch.Tensor, rank_: int | None = None, world: int | None = None) -> torch.Tensor:
    """This rank's rows of a global batch (torch.tensor_split along dim 0)."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    if batch.shape[0] < world:
        raise ValueError(f"a batch of {batch.shape[0]} samples cannot feed {world} ranks (each "
                         f"needs at least one); use a batch of at least {world} or fewer ranks")
    # tensor_split: the first B mod K ranks get one sample more (see shard_weight)
    return torch.tensor_split(batch, world)[rank_]


def shard_weight(local: int, global_: int, world: int | None = None) -> float:
    """K x local / global: scale a rank's mean loss by this so every sample counts once."""
    world = world_size() if world is None else world
    # a mean over `local` samples times K x local / global, then averaged over K ranks:
    # every sample ends up weighted 1 / global, as in one process
    return world * local / global_


def single_process_sgd(model: nn.Module, batches, loss_fn, lr: float, momentum: float = 0.0
                       ) -> tuple[list[float], torch.Tensor]:
    """The reference every data-parallel method is held to: one process, whole batches,
    SGD (plain unless `momentum`). Returns the loss of each step and the final flattened
    parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        # backward adds into .grad: clear it before the next step
        opt.zero_grad()
        losses.append(loss.item())
    # detach: a plain tensor to compare with, outside any graph
    return losses, parameters_to_vector(model.parameters()).detach()


def bucket_parameters(params: list[nn.Parameter], bucket_bytes: int | None,
                      first_bucket_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """Consecutive groups of `params` of at most `bucket_bytes` each (a larger parameter
    gets a group of its own; None: one parameter per group). A change of dtype starts a new
    group, since a bucket is one flat buffer. `first_bucket_bytes` caps the first group:
    torch's DDP keeps it small so the first all-reduce starts early in backward."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        cap = bucket_bytes
        if len(groups) == 1 and bucket_bytes is not None and first_bucket_bytes is not None:
            cap = min(bucket_bytes, first_bucket_bytes)  # still filling the first group
        if (not groups or cap is None or size + nbytes > cap
                or groups[-1][0].dtype != p.dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


class _Bucket:
    """Parameters whose gradients travel together in one flat tensor. Each parameter's
    .grad becomes a view into it (as DDP's gradient_as_bucket_view): backward then adds
    into the bucket directly and the all-reduced average is already in .grad, so no
    gradient is copied in or out, unless something replaced .grad (zero_grad() sets it
    to None), when it is copied in once and made a view again."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index, self.params = index, params
        # zeros: a parameter that gets no gradient in a step contributes zero to the average
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                device=params[0].device)
        self.views, offset = {}, 0  # id(parameter) -> its slice of flat
        for p in params:
            self.views[id(p)] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.waiting = len(params)

    def adopt(self, param: nn.Parameter) -> None:
        """Make param.grad its view into the bucket (copying the gradient in if it is not)."""
        view = self.views[id(param)]
        # same storage address: .grad still is our view, and backward added into the bucket itself
        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)
            param.grad = view

    def pack(self) -> None:
        for p in self.params:
            self.adopt(p)


class DataParallel(nn.Module):
    """Wrap a module so that `loss.backward()` leaves every rank with averaged gradients.

    bucket_bytes=None all-reduces each parameter on its own; a number groups
    parameters (in reverse order, roughly the order backward produces their
    gradients) into buckets of about that many bytes. overlap=True starts each
    bucket's all-reduce on a communication thread as soon as its last gradient is
    ready, while backward goes on computing (the first bucket is capped at
    FIRST_BUCKET_BYTES, as DDP does, so communication starts early); overlap=False
    all-reduces everything after backward. Buckets are launched in the same order on
    every rank. Replicas start equal: rank 0's parameters and buffers are broadcast at
    construction. `group`: the ranks that hold replicas (a mesh's data-parallel
    dimension; default every rank). `comm`: the communication thread to use, shared by
    wrappers whose collectives over one group must keep one order; default a thread of
    its own.
    """

    def __init__(self, module: nn.Module, bucket_bytes: int | None = 1 << 20,
                 overlap: bool = True, algorithm: str = "ring", group=None,
                 comm: CommThread | None = None) -> None:
        super().__init__()
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool)
                                         or not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes must be a positive int (bytes per bucket) or None "
                             f"(one all-reduce per parameter); got {bucket_bytes!r}")
        if algorithm not in collectives.ALL_REDUCE_ALGORITHMS:
            raise ValueError(f"algorithm must be one of {collectives.ALL_REDUCE_ALGORITHMS}; "
                             f"got {algorithm!r}")
        self.module, self.overlap, self.algorithm = module, overlap, algorithm
        self.group = group
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                # rank 0's values into every replica, as torch's DDP does at construction; buffers
                # too (BatchNorm's running statistics), and in place on .data, outside autograd
                collectives.broadcast(tensor.data, src=0, group=group)
        trainable = [p for p in module.parameters() if p.requires_grad]
        # backward produces gradients from the last layer to the first: bucket in that order
        groups = bucket_parameters(list(reversed(trainable)), bucket_bytes, FIRST_BUCKET_BYTES)
        self.buckets = [_Bucket(i, g) for i, g in enumerate(groups)]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync = True
        self._started = False
        self._next = 0
        self._ready: set[int] = set()
        self._comm = comm if comm is not None else CommThread("minipar-dp-comm")
        for p in trainable:
            # fires after the gradient is added into .grad (torch >= 2.1): the bucket sees the final
            # gradient, even for a parameter used twice in the forward
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next synchronized
        backward all-reduces the accumulated sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # --- during backward ---

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._started:
            self._started = True
            # run _finish once this backward pass has ended; torch's DDP reducer queues its
            # finalization the same way
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[param]
        bucket.adopt(param)
        bucket.waiting -= 1
        if bucket.waiting == 0 and self.overlap:
            self._ready.add(bucket.index)
            self._launch_ready()

    def _launch_ready(self) -> None:
        # collectives match across ranks by the order they are called: a bucket that is ready early
        # waits for the ones before it
        while self._next in self._ready:  # strictly in bucket order, on every rank
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        # for parameters whose hook never fired (unused in this forward): zeros or their old .grad
        bucket.pack()
        if self.overlap:
            self._comm.submit(self._all_reduce, bucket)
        else:
            self._all_reduce(bucket)

    def _all_reduce(self, bucket: _Bucket) -> None:
        # buckets are built alike on every rank (checked by the broadcast at construction),
        # so the per-call shape handshake would only cost time, as DDP does not pay it
        with record("all_reduce", f"bucket {bucket.index}", bytes=bucket.flat.numel()
                    * bucket.flat.element_size()), collectives.validation(False):
            # avg, torch DDP's convention: the loss-scaling rule in the module docstring relies on
            # it
            collectives.all_reduce(bucket.flat, op="avg", algorithm=self.algorithm,
                                   group=self.group)

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters count as zero
        gradients), wait for every bucket, and write the averages into .grad."""
        with record("wait", "gradient sync"):
            # buckets not launched yet: all of them without overlap, or those holding unused
            # parameters
            for bucket in self.buckets[self._next:]:
                self._launch(bucket)
            try:
                self._comm.join()
            except Exception as error:
                raise RuntimeError(f"gradient all-reduce failed on rank {rank()}: {error}"
                                   ) from error
        for bucket in self.buckets:  # the averages are in .grad already: it views them
            # reset for the next backward pass
            bucket.waiting = len(bucket.params)
        self._started, self._next, self._ready = False, 0, set()
