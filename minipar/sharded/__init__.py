"""Sharded data parallelism (lesson 06): data parallelism whose model states are split
over the ranks instead of copied.

- `zero.py`: ZeRO stages 1 and 2 (`ZeroDataParallel`: optimizer state, then gradients,
  sharded over the ranks on a padded flat view, `FlatShard`);
- `fsdp.py`: ZeRO stage 3 / FSDP (`FullyShardedDataParallel`: parameters sharded too,
  gathered one unit at a time for forward and again for backward);
- `lifecycle.py`: `unit_lifecycle`, one step's moments and the units whole at each;
- `memory.py`: `MemoryTracker` (bytes held per kind) and activation recomputation;
- `bench.py` (`minipar bench zero`: memory against the formula, time against torch's
  FSDP2), `exercises.py` (lesson 06's checks), `demo.py` (`python -m minipar.sharded`).
"""

from .fsdp import FullyShardedDataParallel
from .lifecycle import Moment, unit_lifecycle
from .zero import FlatShard, ZeroDataParallel

__all__ = ["FlatShard", "FullyShardedDataParallel", "Moment", "ZeroDataParallel",
           "unit_lifecycle"]
