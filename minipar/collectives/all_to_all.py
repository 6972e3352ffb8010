"""All-to-all with uneven pieces: what expert parallelism dispatches tokens with."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import device
from .comm import _agree, _check_tensor, _Comm, validating
from .host_staging import wire_device


def _check_counts(name: str, counts: list[int], size: int, total: int | None) -> None:
    if (len(counts) != size or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                                   for c in counts)
            or (total is not None and sum(counts) != total)):
        what = f" summing to tensor.shape[0]={total}" if total is not None else ""
        raise ValueError(f"{name} must be {size} non-negative ints (one per rank){what}; "
                         f"got {counts!r}")


def swap_counts(send_counts: list[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """Tell every rank how many rows this rank sends it; returns how many rows arrive from
    each rank (one small message per pair, metered as phase "counts")."""
    comm = _Comm("swap_counts", group)
    _check_counts("send_counts", send_counts, comm.size, None)
    # on this rank's device: under NCCL a message must live on the GPU
    counts_out = torch.tensor(send_counts, dtype=torch.int64, device=device())
    counts_in = torch.zeros_like(counts_out)
    # what a rank sends itself never crosses the network
    counts_in[comm.rank] = counts_out[comm.rank]
    others = [r for r in range(comm.size) if r != comm.rank]
    comm.exchange("counts", sends=[(counts_out[r:r + 1], r, r) for r in others],
                  recvs=[(counts_in[r:r + 1], r, r) for r in others])
    return counts_in.tolist()


def all_to_all(tensor: torch.Tensor, send_counts: list[int] | None = None,
               recv_counts: list[int] | None = None,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Piece j of this rank's tensor (along dim 0) goes to rank j; returns the pieces
    received, concatenated in source-rank order.

    `send_counts[j]` rows go to rank j (default: tensor_split's even pieces).
    `recv_counts[j]` rows arrive from rank j: pass them when known (a backward pass
    knows them from its forward, as Megatron's _AllToAll takes both sizes); otherwise
    the ranks first swap their counts with `swap_counts`. The pieces then move in one
    step.
    """
    _check_tensor(tensor)
    comm = _Comm("all_to_all", group)
    if tensor.dim() == 0:
        raise ValueError("all_to_all needs a tensor with at least one dimension")
    rows = tensor.shape[0]
    if send_counts is None:
        send_counts = [p.shape[0] for p in torch.tensor_split(tensor, comm.size)]
    _check_counts("send_counts", send_counts, comm.size, rows)
    if recv_counts is not None:
        _check_counts("recv_counts", recv_counts, comm.size, None)
    _agree(comm, tensor, dim0_may_differ=True)
    if recv_counts is None:
        recv_counts = swap_counts(send_counts, group)
    elif validating() and comm.size > 1:
        _agree_counts(comm, send_counts, recv_counts, tensor)
    # torch.split takes sizes (tensor_split takes split points): one piece per destination
    pieces = torch.split(tensor.contiguous(), send_counts)
    tail = tuple(tensor.shape[1:])
    received = [torch.empty((int(n), *tail), dtype=tensor.dtype, device=tensor.device)
                for n in recv_counts]
    received[comm.rank].copy_(pieces[comm.rank])  # our own piece: a local copy
    others = [r for r in range(comm.size) if r != comm.rank]
    comm.exchange("exchange", sends=[(pieces[r].reshape(-1), r, r) for r in others],
                  recvs=[(received[r].view(-1), r, r) for r in others])
    return torch.cat(received)


def _agree_counts(comm: _Comm, send_counts: list[int], recv_counts: list[int],
                  tensor: torch.Tensor) -> None:
    """With validation on: every rank's recv_counts must be what the others send it."""
    mine = torch.tensor(send_counts, dtype=torch.int64, device=wire_device(tensor, comm.group))
    everyone = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(everyone, mine, group=comm.group)
    expected = [int(row[comm.rank]) for row in everyone]
    if expected != list(recv_counts):
        raise ValueError(f"all_to_all: rank {comm.rank} expects {list(recv_counts)} rows from "
                         f"ranks 0..{comm.size - 1} but they send {expected}; pass the "
                         "recv_counts that swap_counts(send_counts) returns")
