"""Under torchrun (RANK and WORLD_SIZE set), `launch` joins that process group and
runs the function in this process: how minipar scales past one machine."""

from __future__ import annotations

import atexit
import datetime
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import trace
from .device import (
    _bind_device,
    faked_for_task,
    faked_requested,
    nccl_device_id,
    on_the_host,
    on_this_device,
    rank,
    resolve_backend,
    world_size,
)
from .errors import Results
from .gloo_threads import calm_from_birth
from .worker import in_rank


def under_torchrun() -> bool:
    """True in a process torchrun started (and not in one of minipar's own ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not in_rank()


def ranks_per_node(default: int | None = None) -> int:
    """How many ranks share a node, as the launcher placed them: torchrun's
    LOCAL_WORLD_SIZE (its --nproc-per-node), whose ranks are numbered node by node. Ranks
    minipar spawned share one machine: `default` when given (an emulated layout), else all
    of them. Call it inside a rank."""
    if not under_torchrun():
        return world_size() if default is None else default
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    node, local = int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if node * per_node + local != int(os.environ["RANK"]):
        # torchrun numbers ranks node by node when every node runs the same --nproc-per-node
        raise ValueError(f"rank {os.environ['RANK']} is not node {node} x {per_node} + local "
                         f"rank {local}: give every torchrun agent the same --nproc-per-node")
    return per_node


def _leave_process_group() -> None:
    """Destroy the group minipar joined under torchrun before the interpreter exits
    (left to exit-time destructors, gloo's threads can abort the process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_ATTEMPT: tuple[int, dist.TCPStore] | None = None  # this worker's attempt, counted once


def elastic_attempt(timeout: float = 60.0) -> int:
    """Which attempt of a torchrun job this worker belongs to: 0 for the first, r after
    the r-th restart (--max-restarts); 0 outside torchrun's elastic agent.

    Counted in the rendezvous store, not read from TORCHELASTIC_RESTART_COUNT: on several
    nodes only the failed node's agent counts a restart (a surviving agent restarts its
    workers for the new rendezvous round with its count unchanged), so the count differs
    between nodes. Every worker of every attempt adds one to a counter, once; attempt r's
    workers read r*W+1 .. (r+1)*W. (A worker that died before adding would shift the next
    attempt's count; a failure at start-up ends the job rather than restart it.)"""
    global _ATTEMPT
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return 0
    if _ATTEMPT is None:
        me, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                              is_master=not agent_hosts and me == 0,
                              timeout=datetime.timedelta(seconds=timeout))
        _ATTEMPT = ((store.add("minipar/joined", 1) - 1) // size, store)
    return _ATTEMPT[0]


def _attempt_store(timeout: float) -> dict:
    """After torchrun restarts its workers (--max-restarts), the rendezvous store can still
    hold the addresses the dead attempt's ranks published, and a new rank may connect to
    one of them (refused, or a hang). Keys under a prefix per attempt (`elastic_attempt`)
    keep attempts apart. Returns init_process_group's store=, rank=, world_size= (nothing
    outside elastic)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return {}
    attempt = elastic_attempt(timeout)
    return {"store": dist.PrefixStore(f"minipar/attempt-{attempt}", _ATTEMPT[1]),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def run_under_torchrun(fn: Callable, size: int, args: tuple, kwargs: dict, backend: str,
                        timeout: float, device: str = "auto") -> Results:
    env_size = int(os.environ["WORLD_SIZE"])
    if size != env_size:
        raise ValueError(f"world_size={size} but torchrun started {env_size} processes; "
                         f"pass world_size={env_size} (or minipar.world_size())")
    if not dist.is_initialized():
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        backend = resolve_backend(backend, local_size)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        _bind_device(backend, local_rank, device)
        if backend == "gloo":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        with calm_from_birth():  # as worker.py's init (gloo_threads.py)
            dist.init_process_group(backend,
                                    timeout=datetime.timedelta(seconds=max(timeout, 60)),
                                    device_id=nccl_device_id(backend),
                                    **_attempt_store(max(timeout, 60)))
        atexit.register(_leave_process_group)
    started = time.perf_counter()
    dist.barrier()  # a common t=0 for every rank's events, as in worker._run_task
    # the faked device, as launch's ranks run it (faked_device.py)
    with trace.capture(rank()) as captured, faked_for_task(faked_requested(),
                                                            int(os.environ.get("LOCAL_RANK", 0))):
        args, kwargs = on_this_device((args, kwargs))  # as worker._run_task
        result = on_the_host(fn(*args, **kwargs))
    gathered: list = [None] * size
    # every process gets every rank's result, as launch() returns them on one machine
    dist.all_gather_object(gathered, (result, captured.events))
    results = Results(r for r, _ in gathered)
    results.timeline = trace.Timeline(e for _, events in gathered for e in events)
    results.outputs = [""] * size  # under torchrun, ranks print directly
    results.seconds = time.perf_counter() - started
    return results
