"""Data parallelism (lesson 02): the same model on every rank, different samples.

- `ddp.py`: all-reduce data parallelism from scratch (`DataParallel`: per parameter or
  in buckets, overlapped with backward), the sharding and loss-scaling convention
  (`shard`, `shard_weight`) and the single-process reference (`single_process_sgd`);
- `parameter_server.py`: server ranks hold the weights, workers push gradients;
- `compression.py`: top-k, int8, PowerSGD and per-layer levels, with error feedback
  (measured here by the SpeedupLab; lesson 10 builds on it);
- `speedup.py`: the SpeedupLab's weak-scaling measurement and model;
- `task.py`: the small regression task every data-parallel demo trains;
- `bench.py`, `exercises.py` (lesson 02's checks), `demo.py` (`python -m
  minipar.data_parallel`).

Sharding the model's states (ZeRO, FSDP) is `minipar.sharded` (lesson 06); talking less
or to fewer peers, and surviving a dead rank, is `minipar.slow_networks` (lesson 10).
"""

from .ddp import (
    FIRST_BUCKET_BYTES,
    DataParallel,
    bucket_parameters,
    shard,
    shard_weight,
    single_process_sgd,
)

__all__ = ["FIRST_BUCKET_BYTES", "DataParallel", "bucket_parameters",
           "shard", "shard_weight", "single_process_sgd"]
