"""Putting it together: a device mesh whose dimensions each run one technique.

- `mesh.py`: `Mesh(dp=2, pp=2, tp=2)`, the ranks as a grid with named dimensions, its
  groups as a table, and `connect()` for each dimension's process groups;
- `model.py`, `decoder_layers.py`, `stage_data_parallel.py`: the decoder cut into layers for
  this rank's tp and cp coordinates, shared out as pipeline stages over pp, and data
  parallelism (DDP, ZeRO-1/2/3) over each stage; `twin_check.py` composes them and
  checks the result against one process (lesson 07, the demo), as the trainer composes
  them (`train/model_part.py`);
- `sbp.py`, `reshard.py`: where a tensor lives (split, broadcast, partial) and the
  collectives that move it between placements and between meshes;
- `planner.py`: the degrees for a model on a cluster, and why;
- `exercises.py`, `demo.py`, `bench.py`: lesson 07's checks, `python -m minipar.mesh` and
  `minipar bench mesh` (does the planner rank real runs as they measure?).
"""

from .mesh import Mesh, MeshGroups

__all__ = ["Mesh", "MeshGroups"]
