"""The GPU check's point-to-point matrix: each way minipar's code posts messages, on K
ranks, at several sizes, checked value by value.

The NCCL rehearsal (nccl_replay.py) replays these patterns under NCCL's rules on a CPU;
this runs them on NCCL itself, where what the replay cannot model shows: real buffering
(a small send may complete before its receive is posted, a large one may not), and the
real streams. Each pattern is one of the shapes the library's messages take:

- send/recv, isend/recv, send/irecv: one message, each end blocking or not;
- both send first: two ranks swap, each posting its send before its receive (minipar
  posts the pair as one batch: `sendrecv`);
- ring: every rank sends to the next and receives from the one before (ring all-reduce,
  ring attention);
- the 1F1B crossing: a stage sends forward while its neighbour sends a gradient back
  (the pipeline posts both ends of the crossing in one batch);
- posted ahead: a receiver posts two receives before the sender sends either, and the
  messages must land in order.

Pairs are ranks (0, 1), (2, 3), ...: with an odd K the last rank sits out the pair
patterns and joins the ring.
"""

from __future__ import annotations

import torch

from .. import collectives as C
from ..runtime import device, device_seconds, rank, world_size

PATTERNS = ("send/recv", "isend/recv", "send/irecv", "both send first", "ring",
            "1F1B crossing", "posted ahead")
KIB, MIB = 1 << 10, 1 << 20


def _filled(owner: int, numel: int, salt: int = 0) -> torch.Tensor:
    """What rank `owner` sends: small integers in float32 (exact), different per rank."""
    return (torch.arange(numel, device=device()) % 97 + 1000 * owner + salt).float()


def _peer() -> int | None:
    me, k = rank(), world_size()
    peer = me ^ 1
    return peer if peer < k else None


def _run(pattern: str, numel: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run `pattern` once; (what arrived, what should have) for each receive here."""
    me, k, peer = rank(), world_size(), _peer()
    mine = _filled(me, numel)
    into = torch.empty(numel, device=device())
    if pattern == "ring":
        C.sendrecv(mine, (me + 1) % k, into, (me - 1) % k)
        return [(into, _filled((me - 1) % k, numel))]
    if peer is None:
        return []
    sender = me % 2 == 0
    if pattern == "send/recv":
        if sender:
            C.send(mine, peer)
            return []
        return [(C.recv(into, peer), _filled(peer, numel))]
    if pattern == "isend/recv":
        if sender:
            C.isend(mine, peer).wait()
            return []
        return [(C.recv(into, peer), _filled(peer, numel))]
    if pattern == "send/irecv":
        if sender:
            C.send(mine, peer)
            return []
        return [(C.irecv(into, peer).wait(), _filled(peer, numel))]
    if pattern in ("both send first", "1F1B crossing"):
        if pattern == "both send first":
            C.sendrecv(mine, peer, into, peer)
        else:  # the stage before sends an activation, the one after a gradient back
            C.post_together([(mine, peer)], [(into, peer)],
                            label="F1" if sender else "B0").wait()
        return [(into, _filled(peer, numel))]
    if pattern == "posted ahead":
        if sender:
            C.send(mine, peer)
            C.send(_filled(me, numel, salt=7), peer)
            return []
        second = torch.empty(numel, device=device())
        ahead = [C.irecv(into, peer), C.irecv(second, peer)]
        for pending in ahead:
            pending.wait()
        return [(into, _filled(peer, numel)), (second, _filled(peer, numel, salt=7))]
    raise ValueError(f"pattern must be one of {PATTERNS}; got {pattern!r}")


def pattern_on_rank(pattern: str, sizes: tuple[int, ...]) -> dict:
    """On each rank: `pattern` at each size in bytes, every received value checked, and
    the best of three runs' device time. {"wrong": [sizes], "seconds": {size: s}}."""
    wrong, seconds = [], {}
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        checks = _run(pattern, numel)
        if not all(torch.equal(got, want) for got, want in checks):
            wrong.append(nbytes)
        seconds[nbytes] = device_seconds(lambda n=numel: _run(pattern, n))
    return {"wrong": wrong, "seconds": seconds}


def size_name(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"
