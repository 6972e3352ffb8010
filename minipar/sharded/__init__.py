"""Sharded data parallelism (lesson 06): data parallelism whose model states are split
over the ranks instead of copied.

- `zero.py`: ZeRO stages 1 and 2 (`ZeroDataParallel`: optimizer state, then gradients,
  sharded over the ranks on a padded flat view, `FlatShard`);
- `fsdp.py`: ZeRO stage 3 / FSDP (`FullyShardedDataParallel`: parameters sharded too,
  gathered one unit at a time for forward and again for backward);
- `lifecycle.py`: `unit_lifecycle`, one step's moments and the units whole at each;
- `memory_tracker.py`: `MemoryTracker` (bytes held per kind, a device budget) and activation
  recomputation;
- `swap.py`, `offload.py`: memory beyond the device (`Offload`: layers' parameters,
  optimizer state and saved activations in host memory, prefetched on a copy stream);
  `karma.py`: KARMA's swap-or-recompute plan from a fitted cost model;
  `zero_offload.py`: ZeRO-Offload (`host_optimizer`: ZeRO's sharded step on the host);
- `bench.py` (`minipar bench zero`: memory against the formula, time against torch's
  FSDP2), `offload_bench.py` (`minipar bench offload`), `exercises.py` (lesson 06's
  checks), `demo.py` (`python -m minipar.sharded`).
"""

from .fsdp import FullyShardedDataParallel
from .lifecycle import Moment, unit_lifecycle
from .offload import Offload
from .zero import FlatShard, ZeroDataParallel
from .zero_offload import host_optimizer

__all__ = ["FlatShard", "FullyShardedDataParallel", "Moment", "Offload", "ZeroDataParallel",
           "host_optimizer", "unit_lifecycle"]
