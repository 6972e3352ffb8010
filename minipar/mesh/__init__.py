"""Putting it together: a device mesh whose dimensions each run one technique.

- `mesh.py`: `Mesh(dp=2, pp=2, tp=2)`, the ranks as a grid with named dimensions, its
  groups as a table, and `connect()` for each dimension's process groups;
- `gpt.py`: `MeshGPT`, the tiny GPT trained with data x pipeline x tensor parallelism
  (ZeRO-1 over dp as an option), checked against one process (MoE experts over an `ep`
  dimension compose with a Mesh from the MoE package, above this one);
- `sbp.py`, `reshard.py`: where a tensor lives (split, broadcast, partial) and the
  collectives that move it between placements and between meshes;
- `planner.py`: the degrees for a model on a cluster, and why;
- `exercises.py`, `bench.py`: lesson 07's checks and `minipar bench mesh`.
"""

from .gpt import MeshGPT, gpt_loss, twin_slice
from .mesh import Mesh, MeshGroups

__all__ = ["Mesh", "MeshGPT", "MeshGroups", "gpt_loss", "twin_slice"]
