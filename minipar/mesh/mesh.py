"""A device mesh: the ranks laid out as a grid with named dimensions.

`Mesh(dp=2, pp=2, tp=2)` numbers 8 ranks in row-major order, the last dimension
fastest, as `torch.distributed.device_mesh` and Megatron-LM do: ranks 0 and 1 differ
only in tp, so a tensor-parallel group is two neighbouring ranks, which on a real
cluster sit in one node behind its fast links. Each dimension cuts the ranks into
groups (the ranks that differ only along it); a technique runs inside its dimension's
group, e.g. tensor parallelism all-reduces over `tp`, data parallelism over `dp`.

The layout is plain arithmetic, usable anywhere (print it, draw it, plan with it).
`connect()`, called by every rank of a launched run, creates each dimension's process
groups once and returns them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from ..report import format_table
from ..runtime import new_groups, rank, world_size


class Mesh:
    """A grid of ranks with named dimensions, first named = outermost (slowest)."""

    def __init__(self, **dims: int) -> None:
        if not dims:
            raise ValueError("a Mesh needs at least one dimension, e.g. Mesh(dp=2, tp=2)")
        for name, size in dims.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dimension {name} must be a positive int; got {size!r}")
        self.names: tuple[str, ...] = tuple(dims)
        self.shape: tuple[int, ...] = tuple(dims.values())
        self.size = math.prod(self.shape)

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={s}' for n, s in zip(self.names, self.shape, strict=True))})"

    def __getitem__(self, name: str) -> int:
        """The size of dimension `name`."""
        return self.shape[self._axis(name)]

    def _axis(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"dimension must be one of {self.names}; got {name!r}")
        return self.names.index(name)

    def coords(self, rank_: int) -> dict[str, int]:
        """Where `rank_` sits: its index along every dimension."""
        if not 0 <= rank_ < self.size:
            raise ValueError(f"rank must be in 0..{self.size - 1} for {self}; got {rank_}")
        out = {}
        # row-major: peel the last (fastest) dimension off first, like digits of a mixed radix
        for name, size in zip(reversed(self.names), reversed(self.shape), strict=True):
            rank_, out[name] = divmod(rank_, size)
        return {n: out[n] for n in self.names}

    def rank_at(self, **coords: int) -> int:
        """The rank at these coordinates (every dimension named)."""
        if set(coords) != set(self.names):
            raise ValueError(f"name every dimension {self.names}; got {tuple(coords)}")
        r = 0
        for name, size in zip(self.names, self.shape, strict=True):
            if not 0 <= coords[name] < size:
                raise ValueError(f"{name} must be in 0..{size - 1}; got {coords[name]}")
            # Horner's rule in the mesh's mixed radix: the inverse of coords()
            r = r * size + coords[name]
        return r

    def groups(self, *names: str) -> list[list[int]]:
        """Every group along dimension `name`: ranks that agree on all other coordinates,
        in order of their index along `name`. Each rank is in exactly one. Several names
        join their dimensions into one group (`groups("dp", "cp")`: the ranks that differ
        only in dp and cp, as data parallelism over context-parallel ranks needs)."""
        if not names:
            raise ValueError(f"name at least one dimension of {self.names}")
        for name in names:
            self._axis(name)
        found: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            # key: every other coordinate; ranks come in increasing order, so index order
            found.setdefault(tuple(v for n, v in c.items() if n not in names), []).append(r)
        return list(found.values())

    def group_of(self, name: str, rank_: int) -> list[int]:
        """The ranks that share `rank_`'s group along `name`."""
        return next(g for g in self.groups(name) if rank_ in g)

    def table(self) -> str:
        """One row per rank: its coordinates and its group along every dimension."""
        rows = [{"rank": r, **self.coords(r),
                 **{f"{n} group": " ".join(map(str, self.group_of(n, r))) for n in self.names}}
                for r in range(self.size)]
        columns = [("rank", "rank"), *[(n, n) for n in self.names],
                   *[(f"{n} group", f"{n} group") for n in self.names]]
        return format_table(rows, columns)

    def connect(self, *joined: tuple[str, ...]) -> MeshGroups:
        """Create every dimension's process groups (each rank must call this, in the same
        order: torch creates a group collectively) and return this rank's. Each tuple of
        names in `joined` also gets a group over those dimensions together, named by the
        names joined with "_" (`connect(("dp", "cp"))` -> `groups.dp_cp`)."""
        if world_size() != self.size:
            raise ValueError(f"{self} has {self.size} ranks but this run has {world_size()}; "
                             f"launch {self.size} ranks or change the dimensions")
        # every rank makes every group (torch's new_group is collective), in the same order
        mine = {"_".join(names): new_groups(self.groups(*names))
                for names in [(name,) for name in self.names] + [tuple(j) for j in joined]}
        return MeshGroups(self, rank(), mine)

    def fresh_group(self, *names: str) -> dist.ProcessGroup:
        """This rank's group over dimensions `names`, created anew (every rank calls it, in
        the same order): the same ranks as connect's, but collectives on it never queue
        behind those another thread runs on connect's (gloo matches them by group)."""
        return new_groups(self.groups(*names))


@dataclass
class MeshGroups:
    """One rank's view of a connected mesh: its coordinates and a process group per
    dimension (`groups.tp` is what tensor-parallel layers take as `group=`)."""

    mesh: Mesh
    rank: int
    by_name: dict[str, dist.ProcessGroup]

    def __getattr__(self, name: str) -> dist.ProcessGroup:
        # dunders (copy and pickle probe them) and our own fields (absent mid-unpickling) raise
        # at once: the lookup below reads self.mesh, which would re-enter __getattr__ forever
        if name.startswith("__") or name in ("mesh", "rank", "by_name"):
            raise AttributeError(name)
        if name not in self.by_name:  # a joined group (connect's `joined`) or a dimension
            self.mesh._axis(name)
        return self.by_name[name]

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)
