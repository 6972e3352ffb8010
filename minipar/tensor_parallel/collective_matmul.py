"""Tensor parallelism overlapped with its own communication: the collective matmul.

Under sequence parallelism a column-parallel layer all-gathers the sequence and then
multiplies, and a row-parallel layer multiplies and then reduce-scatters the sequence.
Done in that order, the link and the arithmetic take turns, and each waits for the other.
Both collectives move the sequence in tp chunks around a ring, and a matmul needs only
one chunk of the sequence at a time, so the two can be interleaved:

- **all-gather + matmul** (`all_gather_matmul`): multiply the chunk this rank holds while
  it travels on to the next rank and the previous rank's chunk arrives; after tp - 1
  shifts every chunk has been multiplied here, and the gathered input is a by-product.
- **matmul + reduce-scatter** (`matmul_reduce_scatter`): a running sum travels the other
  way. Each step this rank computes its partial product for the chunk that arrives next,
  adds the sum it receives, and passes it on; after tp - 1 shifts the sum it keeps is
  its own chunk, summed over every rank.

The bytes are a ring all-gather's and a ring reduce-scatter's; what changes is that the
shifts run on a communication thread (`CommThread`) while the main thread multiplies.
This is why overlap needs sequence parallelism's pair (TransformerEngine#746): an
all-reduce's result is needed whole before anything can use it, but an all-gather's
chunks are useful one at a time. The same idea is async TP in torchtitan,
tp-comm-overlap in Megatron, and the "collective matmul" of Wang et al. 2023 (the JAX
scaling book's chapter on it).

The backward of each is the other: the input's gradient of an all-gather + matmul is a
matmul + reduce-scatter, and of a matmul + reduce-scatter an all-gather + matmul (whose
gathered gradient gives the weight's gradient too). `OverlappedColumnParallelLinear` and
`OverlappedRowParallelLinear` are the layers; they equal `ColumnParallelLinear` and
`RowParallelLinear` with `sequence_parallel=True` to rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import trace
from ..collectives import sendrecv
from ..collectives.background import CommThread
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import SEQUENCE_DIM, _tp

# one thread per process: every rank shifts its chunks in the same order, so they match
_SHIFTS = CommThread("minipar-tp-overlap")


def _shift(chunk: torch.Tensor, to: int, frm: int, group) -> torch.Tensor:
    """Send `chunk` to rank `to` and receive one of the same shape from `frm` (group ranks):
    one step of a ring, the send and the receive in one batch."""
    return sendrecv(chunk, to, torch.empty_like(chunk), frm, group, label="tp overlap")


def _waited(future, step: int) -> torch.Tensor:
    # the main thread stops here only if the shift is slower than the matmul it overlapped:
    # the "wait" event is the communication left exposed
    with trace.record("wait", "tp overlap", step=step):
        return future.result()


def _matmul(x: torch.Tensor, weight: torch.Tensor, step: int) -> torch.Tensor:
    with trace.record("compute", "matmul chunk", step=step):
        return x @ weight.t()


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group=None,
                      dim: int = SEQUENCE_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(x, dim) @ weight^T, all_gather(x, dim)), each chunk multiplied while the
    next one travels. x is this rank's slice of dimension `dim`; weight is [out, in]."""
    me, size = _tp(group)
    held = x.contiguous()
    products: list = [None] * size
    gathered: list = [None] * size
    for step in range(size):
        # after `step` shifts this rank holds the chunk that started on rank me - step
        owner = (me - step) % size
        future = _SHIFTS.submit(_shift, held, (me + 1) % size, (me - 1) % size, group) \
            if step < size - 1 else None
        products[owner] = _matmul(held, weight, step)
        gathered[owner] = held
        if future is not None:
            held = _waited(future, step)
    return torch.cat(products, dim), torch.cat(gathered, dim)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None,
                          dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """reduce_scatter(x @ weight^T, dim): this rank's slice of dimension `dim` of the sum
    over ranks, each partial product computed while the running sum travels."""
    me, size = _tp(group)
    if x.shape[dim] % size:
        raise ValueError(f"the sequence ({x.shape[dim]} tokens) must divide by the "
                         f"tensor-parallel size {size}; choose a multiple of {size}")
    chunks = x.chunk(size, dim)
    future = None
    for step in range(size):
        # the sum travels to rank me - 1: at step s it carries chunk me + s + 1's partial sums
        # from the ranks after this one, and at the last step (s = size - 1) chunk me's
        partial = _matmul(chunks[(me + step + 1) % size], weight, step)
        if future is not None:
            partial = partial + _waited(future, step)
        if step == size - 1:
            return partial
        future = _SHIFTS.submit(_shift, partial, (me - 1) % size, (me + 1) % size, group)
    raise AssertionError("unreachable: the loop returns at its last step")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherLinear(torch.autograd.Function):
    """y = all_gather(x) @ W^T; backward: dx = reduce_scatter(dy @ W), dW = dy^T x_gathered."""

    @staticmethod
    def forward(ctx, x, weight, group, dim):
        y, gathered = all_gather_matmul(x, weight, group, dim)
        # the gathered input is kept for dW (Megatron instead gathers it again in backward,
        # overlapped with dx, to hold only a slice): memory traded for a simpler backward
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.dim = group, dim
        return y

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        # an input that needs no gradient (the first layer's data) skips its reduce-scatter;
        # every tp rank holds the same graph, so all of them skip it or none does
        grad_x = matmul_reduce_scatter(grad, weight.t(), ctx.group, ctx.dim) \
            if ctx.needs_input_grad[0] else None
        grad_w = _flat(grad).t() @ _flat(gathered) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """y = reduce_scatter(x @ W^T); backward: dx = all_gather(dy) @ W, dW = all_gather(dy)^T x."""

    @staticmethod
    def forward(ctx, x, weight, group, dim):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dim = group, dim
        return matmul_reduce_scatter(x, weight, group, dim)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # the gathered gradient is needed for dW whether or not x wants its own gradient
        grad_x, gathered = all_gather_matmul(grad, weight.t(), ctx.group, ctx.dim)
        grad_w = _flat(gathered).t() @ _flat(x) if ctx.needs_input_grad[1] else None
        return grad_x if ctx.needs_input_grad[0] else None, grad_w, None, None


def _sequence_parallel_only(layer: nn.Module, name: str) -> None:
    if not layer.sequence_parallel:
        raise ValueError(f"{name} overlaps sequence parallelism's all-gather and "
                         "reduce-scatter; pass sequence_parallel=True (an all-reduce's result "
                         "is needed whole, so it has nothing to overlap with)")
    if not dist.is_initialized():
        raise ValueError(f"{name} runs on ranks: start it inside minipar.launch or a Cluster")


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` under sequence parallelism, its all-gather overlapped with the
    matmul chunk by chunk. Built like its parent (`from_linear(..., sequence_parallel=True)`);
    it gathers its own input, so shared_input and gather_output are refused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _sequence_parallel_only(self, "OverlappedColumnParallelLinear")
        if self.shared_input or self.gather_output:
            raise ValueError("OverlappedColumnParallelLinear gathers its own input and returns "
                             "this rank's columns: use shared_input=False, gather_output=False")
        y = _AllGatherLinear.apply(x, self.weight, self.group, SEQUENCE_DIM)
        return y + self.bias if self.bias is not None else y


class OverlappedRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` under sequence parallelism, its reduce-scatter overlapped with the
    matmul chunk by chunk. Its input is this rank's features (input_is_parallel=True)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _sequence_parallel_only(self, "OverlappedRowParallelLinear")
        if not self.input_is_parallel:
            raise ValueError("OverlappedRowParallelLinear takes this rank's features, as a "
                             "column-parallel layer leaves them: pass input_is_parallel=True")
        y = _LinearReduceScatter.apply(x, self.weight, self.group, SEQUENCE_DIM)
        # the bias once, after the sum (as in the parent): each rank adds it to its own tokens
        return y + self.bias if self.bias is not None else y
