"""The GPU check's collectives: each of minipar's collectives, built from point-to-point
messages, against torch's own (NCCL's kernels on GPUs), on every rank of the run and on a
subgroup, in each dtype and size asked for, and all_to_all with uneven and empty pieces.

Every value sent is a small integer, so any order of summation gives the same bits in
any dtype (bfloat16 holds integers exactly up to 256): results must be equal, not close.
The ring all-reduce is timed beside torch's at each size, on the device's clock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives as C
from ..runtime import device, device_seconds, rank, world_size

ON_GPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
ON_CPU_DTYPES = (torch.float32, torch.float64, torch.int64)


def _data(owner: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # at most 8 ranks x (12 + 8) = 160 when summed: exact in every dtype here
    return (torch.arange(numel, device=device()) % 13 + owner).to(dtype)


def _subgroup() -> tuple[object, list[int]] | None:
    """Every rank but the last, as a group (made on every rank, as new_group requires)."""
    k = world_size()
    if k < 3:
        return None
    members = list(range(k - 1))
    return dist.new_group(members), members


def _versus_torch(numel: int, dtype: torch.dtype, group, members: list[int]) -> list[str]:
    """minipar against torch over `group` (None: every rank); the names that differ."""
    me, k = rank(), len(members)
    if me not in members:
        return []
    local = members.index(me)
    x = _data(me, numel, dtype)
    wrong = []
    expected = x.clone()
    dist.all_reduce(expected, group=group)
    for algorithm in C.ALL_REDUCE_ALGORITHMS:
        if not torch.equal(C.all_reduce(x.clone(), algorithm=algorithm, group=group),
                           expected):
            wrong.append(f"all_reduce {algorithm}")
    if not torch.equal(C.reduce_scatter(x.clone(), group=group),
                       torch.tensor_split(expected, k)[local]):
        wrong.append("reduce_scatter")
    pieces = [torch.empty_like(x) for _ in members]
    dist.all_gather(pieces, x, group=group)
    if not torch.equal(C.all_gather(x, group=group), torch.cat(pieces)):
        wrong.append("all_gather")
    if group is None:
        for algorithm in C.ROOTED_ALGORITHMS:
            theirs = x.clone()
            dist.broadcast(theirs, src=k - 1)
            if not torch.equal(C.broadcast(x.clone(), src=k - 1, algorithm=algorithm),
                               theirs):
                wrong.append(f"broadcast {algorithm}")
    if not _uneven_all_to_all(dtype, group, members):
        wrong.append("all_to_all, uneven with empty pieces")
    return [f"{w} ({dtype}, {numel * x.element_size()} bytes)" for w in wrong]


def _counts(src: int, k: int) -> list[int]:
    """Rows rank `src` sends to each rank: uneven, and none to the rank after it."""
    return [0 if dst == (src + 1) % k else (src + dst) % 3 + 1 for dst in range(k)]


def _uneven_all_to_all(dtype: torch.dtype, group, members: list[int]) -> bool:
    k, me = len(members), members.index(rank())
    send = _counts(me, k)
    mine = _data(me, sum(send) * 4, dtype).view(-1, 4)
    got = C.all_to_all(mine, send_counts=send, recv_counts=[_counts(j, k)[me]
                                                             for j in range(k)], group=group)
    # what rank j sends me: its rows after the ones it sends to ranks before me
    want = []
    for j in range(k):
        rows = _data(j, sum(_counts(j, k)) * 4, dtype).view(-1, 4)
        start = sum(_counts(j, k)[:me])
        want.append(rows[start:start + _counts(j, k)[me]])
    return torch.equal(got, torch.cat(want))


def versus_torch_on_rank(sizes: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> dict:
    """On each rank: every collective against torch's, at each size in bytes and dtype, on
    every rank and on a subgroup; and minipar's ring all-reduce timed beside torch's."""
    subgroup = _subgroup()
    k = world_size()
    wrong, times = [], {}
    for nbytes in sizes:
        for dtype in dtypes:
            numel = max(k, nbytes // torch.empty((), dtype=dtype).element_size() // k * k)
            wrong += _versus_torch(numel, dtype, None, list(range(k)))
            if subgroup is not None:
                wrong += [f"on ranks {subgroup[1]}: {w}"
                          for w in _versus_torch(numel, dtype, *subgroup)]
        x = _data(rank(), max(k, nbytes // 4), torch.float32)
        times[nbytes] = (device_seconds(lambda x=x: C.all_reduce(x.clone())),
                         device_seconds(lambda x=x: dist.all_reduce(x.clone())))
    return {"wrong": wrong, "seconds": times}
