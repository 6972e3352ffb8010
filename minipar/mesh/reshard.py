"""Cross-mesh resharding (Zhuang et al. 2023, "On Optimizing the Communication of Model
Parallelism"): a tensor split over the ranks of one mesh is sent to another mesh that
splits it differently, as between two pipeline stages with different tensor-parallel
degrees. Each destination rank needs some interval of the tensor; each source rank holds
one; every overlap is one point-to-point message."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from ..runtime import device, rank
from .sbp import Broadcast, Placement, Split, placement


@dataclass(frozen=True)
class Message:
    """Rows [start, stop) along the split dimension, from rank `src` to rank `dst`."""

    src: int
    dst: int
    start: int
    stop: int


def _intervals(length: int, ranks: list[int], where: Placement) -> list[tuple[int, int]]:
    if isinstance(where, Broadcast):
        return [(0, length)] * len(ranks)
    k = len(ranks)
    if length % k:
        raise ValueError(f"a dimension of {length} does not split evenly over {k} ranks")
    return [(i * length // k, (i + 1) * length // k) for i in range(k)]


def reshard_plan(length: int, src_ranks: list[int], src: str | Placement,
                 dst_ranks: list[int], dst: str | Placement) -> list[Message]:
    """The messages that move a tensor with `length` rows along its split dimension from
    `src_ranks` placed `src` to `dst_ranks` placed `dst` (each Split(d) with the same d,
    or Broadcast). From a broadcast source, destination j takes its piece from source
    j mod (number of sources), so the sending is spread."""
    s, d = placement(src), placement(dst)
    for name, p in (("src", s), ("dst", d)):
        if not isinstance(p, Split | Broadcast):
            raise ValueError(f"{name} must be Split or Broadcast across meshes; got {p}")
    if isinstance(s, Split) and isinstance(d, Split) and s.dim != d.dim:
        raise ValueError(f"both meshes must split the same dimension; got {s} and {d}")
    have = _intervals(length, src_ranks, s)
    need = _intervals(length, dst_ranks, d)
    messages = []
    for j, (c, e) in enumerate(need):
        if isinstance(s, Broadcast):
            # every source holds everything: spread the sends round-robin, not all from the first
            i = j % len(src_ranks)
            messages.append(Message(src_ranks[i], dst_ranks[j], c, e))
            continue
        for i, (a, b) in enumerate(have):
            # two half-open intervals overlap when the later start comes before the earlier stop
            if max(a, c) < min(b, e):
                messages.append(Message(src_ranks[i], dst_ranks[j], max(a, c), min(b, e)))
    return messages


def reshard(local: torch.Tensor | None, shape: tuple[int, ...], src_ranks: list[int],
            src: str | Placement, dst_ranks: list[int], dst: str | Placement,
            dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Run on every rank of the run: source ranks pass their piece (`local`), destination
    ranks get theirs back (others None). `shape` is the whole tensor's."""
    s, d = placement(src), placement(dst)
    dim = s.dim if isinstance(s, Split) else d.dim if isinstance(d, Split) else 0
    plan = reshard_plan(shape[dim], src_ranks, s, dst_ranks, d)
    me = rank()
    my_start = 0 if isinstance(s, Broadcast) or me not in src_ranks else \
        src_ranks.index(me) * shape[dim] // len(src_ranks)
    sends, recvs, pieces = [], [], {}
    for m in plan:
        if m.src == me:
            # m.start is a global row: subtract where this rank's piece begins; contiguous, as
            # a message must be one dense buffer
            piece = local.narrow(dim, m.start - my_start, m.stop - m.start).contiguous()
            if m.dst == me:
                # a rank in both meshes keeps its overlap: no message to itself
                pieces[m.start] = piece
            else:
                sends.append((piece, m.dst))
    for m in plan:
        if m.dst == me and m.src != me:
            size = list(shape)
            size[dim] = m.stop - m.start
            recvs.append((m.start, torch.empty(size, dtype=dtype, device=device()), m.src))
    # every send and receive in one batch: a rank in both meshes sends while it receives
    landed = collectives.post_together(sends, [(t, src) for _, t, src in recvs]).wait()
    pieces.update({start: t for (start, _, _), t in zip(recvs, landed, strict=True)})
    if me not in dst_ranks:
        return None
    # keyed by global start row: sorting puts the pieces back in order
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=dim)
