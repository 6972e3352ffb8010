"""Run one function on every rank: CPU processes (gloo), one GPU per rank (NCCL), or torchrun.

`launch(fn, world_size)` starts fresh processes, initializes torch.distributed in
each, runs `fn` on every rank and returns the per-rank results in rank order.
`Cluster(world_size)` keeps the ranks alive between calls so that widgets and
benchmarks pay the start-up once.

How ranks are started, and why:
- The function travels by value (cloudpickle), so functions and lambdas defined in a
  notebook cell or in `__main__` work.
- Processes come from a clean "forkserver" that has already imported torch (Linux
  and macOS): children are forks of a fresh single-threaded server, never of the
  notebook kernel, and skip re-importing torch (about 3x faster than "spawn", which
  stays available as `start_method="spawn"`).
- Rendezvous goes through a file in the group's own temporary folder (a FileStore):
  parallel runs never collide, and there is no port and no name lookup. (A TCPStore on
  loopback looked up 127.0.0.1's name for every peer; where the DNS server dropped the
  query, one start in five waited the resolver's 5 s.)
- Each rank writes stdout/stderr to its own file; the caller replays them after the
  run, in rank order, each line prefixed ``[rank r]``, so notebooks and nbval see the
  same text every run.
- Failure is loud and fast: the first rank that raises ends the whole group and the
  caller gets a `RankError` with that rank's traceback. A run that passes its
  timeout ends with a `RankTimeout` naming, for each rank still running, the call it
  was blocked in (read from a faulthandler stack dump). No process outlives its run
  or its Cluster: ranks also kill themselves if the calling process disappears.

The files, in the order a run passes through them: `device` (backend, device, rank),
`cluster` (Cluster, launch), `group` (the launcher's side of the processes),
`worker` (the rank's side), `torchrun` (joining torchrun's group), `errors`; `streams`
(where a rank's GPU work queues, and how background threads hand tensors over).
"""

from .cluster import DEFAULT_TIMEOUT, START_METHODS, Cluster, launch
from .cpu_kind import cpu_kind, cpu_model
from .device import (
    BACKENDS,
    DEVICES,
    allocator_history,
    cpu_cores,
    device,
    device_name,
    gpu_count,
    host_empty_like,
    machine_line,
    memory_peak,
    rank,
    reset_memory_peak,
    resolve_backend,
    resolve_device,
    synchronize,
    world_size,
)
from .errors import RankDied, RankError, RankTimeout, Results
from .gloo_threads import calm_from_birth, calm_gloo_threads, new_groups
from .streams import (
    compute_ready,
    copies_landed,
    device_seconds,
    handed_over,
    on_copy_stream,
    on_stream,
    side_stream,
)
from .torchrun import ranks_per_node, under_torchrun

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT", "DEVICES", "START_METHODS", "allocator_history",
           "calm_from_birth", "calm_gloo_threads", "Cluster", "compute_ready", "copies_landed",
           "cpu_cores", "cpu_kind", "cpu_model", "device", "device_name", "device_seconds",
           "gpu_count", "handed_over", "host_empty_like", "launch", "machine_line", "memory_peak",
           "new_groups", "on_copy_stream", "on_stream", "rank", "RankDied", "RankError",
           "ranks_per_node", "RankTimeout", "reset_memory_peak", "resolve_backend",
           "resolve_device", "Results", "side_stream", "synchronize", "under_torchrun",
           "world_size"]
