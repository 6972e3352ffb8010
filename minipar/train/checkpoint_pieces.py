"""Where each rank's tensors sit in the one-process model's: the placements a sharded
checkpoint records, and the arithmetic that moves values between two placements.

A `Piece` is part of one global tensor (a parameter of the twin, by its name): a block
(an offset and a length per dimension: a tensor-parallel slice, or the whole tensor) and,
within the block, a range of its row-major entries (all of them, or the part of the
block a ZeRO rank's flat slice covers). Every entry of a piece has one global flat
index, so moving values between any two pieces, of any two meshes, is matching indices:
no case for tp, another for ZeRO, another for pp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("param", "exp_avg", "exp_avg_sq")  # a parameter and Adam's two moments


@dataclass(frozen=True)
class Piece:
    """Entries [start, stop) (row-major) of the block at `offsets` with `lengths` of the
    twin's tensor `name` of global `shape`."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    start: int
    stop: int

    @property
    def key(self) -> str:
        """The piece's name in a rank's file: the tensor, its block and its range."""
        return f"{self.name}@{','.join(map(str, self.offsets))}#{self.start}:{self.stop}"

    def global_indices(self) -> torch.Tensor:
        """The global row-major index of each of the piece's entries, increasing."""
        # index bookkeeping, on the host like the files' pieces
        local = torch.arange(self.start, self.stop)
        index = torch.zeros_like(local)
        for dim in range(len(self.shape)):
            inner = math.prod(self.lengths[dim + 1:])
            coordinate = (local // inner) % self.lengths[dim] + self.offsets[dim]
            index = index * self.shape[dim] + coordinate
        return index


@dataclass
class Holding:
    """A piece this rank holds and its values of each kind, as views into the live tensors
    (flat, piece.stop - piece.start entries each): writing them writes the model."""

    piece: Piece
    values: dict[str, torch.Tensor]


def block(shape: tuple[int, ...], local: tuple[int, ...], tp_rank: int
          ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of a tensor-parallel rank's slice: the whole tensor when the
    shapes agree, else chunk `tp_rank` along the one dimension that was split (as
    `mesh.twin_slice` cuts it)."""
    split = [d for d, (a, b) in enumerate(zip(shape, local, strict=True)) if a != b]
    if len(split) > 1:
        raise ValueError(f"a slice {local} of {shape} is split along more than one dimension")
    offsets = [0] * len(shape)
    if split:
        offsets[split[0]] = tp_rank * local[split[0]]
    return tuple(offsets), tuple(local)


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Adam's moments of `p`, created as zeros when no step has run yet (a fresh replica
    about to be loaded)."""
    state = optimizer.state[p]
    if "exp_avg" not in state:
        # torch's Adam keeps its step count on the host
        step = torch.tensor(0.0)
        state.update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    return state


def holdings(named: list[tuple[str, nn.Parameter]], shapes: dict[str, tuple[int, ...]],
             optimizer: torch.optim.Optimizer, shards: list | None, tp_rank: int
             ) -> list[Holding]:
    """What this rank holds of every tensor of the twin (global `shapes` by name): whole
    parameters (`shards` None), or ZeRO's flat slices (FlatShards) mapped back onto the
    parameters they cover. `named` are this rank's parameters under the twin's names."""
    out = []
    if shards is None:
        for name, p in named:
            offsets, lengths = block(shapes[name], tuple(p.shape), tp_rank)
            state = _adam_state(optimizer, p)
            piece = Piece(name, shapes[name], offsets, lengths, 0, p.numel())
            out.append(Holding(piece, {"param": p.data.view(-1),
                                       **{k: state[k].view(-1) for k in KINDS[1:]}}))
        return out
    name_of = {id(p): name for name, p in named}
    for shard in shards:
        state = _adam_state(optimizer, shard.master)
        first, start = shard.rank * shard.slice, 0  # this rank's slice of the padded flat
        for p, local in zip(shard.params, shard.shapes, strict=True):
            lo, hi = max(start, first), min(start + local.numel(), first + shard.slice)
            if lo < hi:  # the slice covers entries [lo - start, hi - start) of p
                name = name_of[id(p)]
                offsets, lengths = block(shapes[name], tuple(local), tp_rank)
                piece = Piece(name, shapes[name], offsets, lengths, lo - start, hi - start)
                span = slice(lo - first, hi - first)
                out.append(Holding(piece, {"param": shard.master.data[span],
                                           **{k: state[k][span] for k in KINDS[1:]}}))
            start += local.numel()
    return out


def fill(target: Holding, sources: list[tuple[Piece, dict[str, torch.Tensor]]]) -> None:
    """Write into `target`'s values every entry the `sources` (pieces of a checkpoint and
    their values) hold of it; one line naming the tensor when some entry is in none."""
    wanted = target.piece.global_indices()
    found = torch.zeros(len(wanted), dtype=torch.bool)
    for piece, values in sources:
        have = piece.global_indices()
        at = torch.searchsorted(wanted, have).clamp(max=len(wanted) - 1)
        hit = wanted[at] == have  # both increasing: a match is where the search lands
        if hit.any():
            for kind, tensor in target.values.items():
                tensor[at[hit]] = values[kind][hit].to(tensor.device, tensor.dtype)
            found[at[hit]] = True
    if not found.all():
        raise ValueError(f"the checkpoint holds no value for {int((~found).sum())} entries of "
                         f"{target.piece.name} {list(target.piece.shape)}")
