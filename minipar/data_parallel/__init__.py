"""Data parallelism: the same model on every rank, different samples.

- `ddp.py`: all-reduce data parallelism from scratch (`DataParallel`: per parameter or
  in buckets, overlapped with backward), the sharding and loss-scaling convention
  (`shard`, `shard_weight`) and the single-process reference (`single_process_sgd`);
- `zero.py`: ZeRO stages 1 and 2 (`ZeroDataParallel`: optimizer state, then gradients,
  sharded over the ranks on a padded flat view, `FlatShard`);
- `fsdp.py`: ZeRO stage 3 / FSDP (`FullyShardedDataParallel`: parameters sharded too,
  gathered one unit at a time for forward and again for backward);
- `parameter_server.py`: server ranks hold the weights, workers push gradients;
- `relaxed.py`: local SGD, CO2-style overlapped averaging, Hogwild!;
- `compression.py`: top-k, int8, PowerSGD and per-layer levels, with error feedback;
- `gossip.py`: stochastic gradient push and grouped all-reduce with group swapping;
- `checkpoint.py`: checkpoint and resume after a killed rank, on fewer ranks;
  `elastic.py`: the same under torchrun --max-restarts;
- `speedup.py`: the SpeedupLab's weak-scaling measurement and model;
- `bench.py`, `exercises.py` (lesson 02's checks), `demo.py` (`python -m
  minipar.data_parallel`).
"""

from .ddp import (
    FIRST_BUCKET_BYTES,
    DataParallel,
    average_gradients,
    shard,
    shard_weight,
    single_process_sgd,
)
from .fsdp import FullyShardedDataParallel
from .zero import FlatShard, ZeroDataParallel

__all__ = ["FIRST_BUCKET_BYTES", "DataParallel", "FlatShard", "FullyShardedDataParallel",
           "ZeroDataParallel", "average_gradients", "shard", "shard_weight",
           "single_process_sgd"]
