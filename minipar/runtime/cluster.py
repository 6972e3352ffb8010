"""`Cluster` (ranks kept alive between runs) and `launch` (one run on fresh ranks)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from .. import trace
from .device import check_sharing, faked_requested, resolve_backend, resolve_device
from .errors import Results
from .group import RankGroup, replay
from .torchrun import run_under_torchrun, under_torchrun
from .worker import in_rank

START_METHODS = ("forkserver", "spawn")  # no plain fork: forking a threaded process can deadlock
# seconds with no progress on any rank (runtime/progress.py); RankTimeout then says where
# each rank waits. No healthy operation of any preset comes near it, on CPU or GPU
DEFAULT_TIMEOUT = 120.0


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int >= 1 (the number of ranks); "
                        f"got {world_size!r} ({type(world_size).__name__})")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (the number of ranks); got {world_size}")
    return world_size


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0; got {timeout!r}")
    return float(timeout)


def _serialize(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be a function to run on every rank; got {fn!r} "
                        f"({type(fn).__name__})")
    try:
        # importable functions and modules travel by name, not by value: the ranks get this
        # process's sys.path so that they can import them too; and whether to run under
        # the faked device, asked for now (the ranks' environment was fixed when they started)
        return cloudpickle.dumps((fn, args, kwargs, list(sys.path), faked_requested()))
    except Exception as err:
        raise TypeError(
            f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
            f"{type(err).__name__}: {err}. The function, its arguments and the globals it "
            "uses must be picklable: create locks, open files, sockets or generators inside "
            "the function instead of capturing them") from None


class Cluster:
    """Ranks kept alive between runs: ``with Cluster(4) as c: c.run(fn)``.

    Each `run` sends the function to every rank and returns the per-rank results in
    rank order. If a run fails (a rank raises, dies or times out) every rank is
    stopped and the next `run` starts fresh ones (state kept in the ranks is lost).
    Process groups a run creates (a mesh's, `dist.new_group`'s) are destroyed as the next
    run starts (each gloo group keeps threads polling its sockets): a run makes the groups
    it uses.
    """

    def __init__(self, world_size: int, backend: str = "auto", *,
                 timeout: float = DEFAULT_TIMEOUT, threads_per_rank: int = 1,
                 start_method: str | None = None, device: str = "auto") -> None:
        self.world_size = _check_world_size(world_size)
        self.timeout = _check_timeout(timeout)
        if start_method is None:
            # forkserver imports torch once and forks ranks from that warm process (fast);
            # spawn, the only choice on Windows, starts each rank as a fresh interpreter
            start_method = "forkserver" if hasattr(os, "fork") else "spawn"
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}; got {start_method!r}")
        if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) \
                or threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be an int >= 1; got {threads_per_rank!r}")
        self.start_method, self.threads_per_rank = start_method, threads_per_rank
        self.backend = resolve_backend(backend, self.world_size)
        self.device = resolve_device(device, self.backend)  # "cpu", "cuda" or "fakegpu"
        check_sharing(self.device, self.backend, self.world_size)
        self.restarts = 0
        self._closed = False
        self._group: RankGroup | None = None
        if in_rank():
            raise RuntimeError("minipar cannot start ranks from inside a rank; "
                               "call launch()/Cluster() from the main process")
        self._start()

    def _start(self) -> None:
        # dropped first: if RankGroup() raises, no stale (stopped) group stays behind
        self._group = None
        self._group = RankGroup(self.world_size, self.backend, self.start_method,
                                 self.threads_per_rank, self.device)

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> Results:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        task = _serialize(fn, args, kwargs)
        return self._run(task, self.timeout if timeout is None else _check_timeout(timeout))

    def _run(self, task: bytes, timeout: float, tolerate_deaths: bool = False) -> Results:
        if self._closed:
            raise RuntimeError("this Cluster is closed; create a new minipar.Cluster to run more")
        if self._group is None or not self._group.alive:
            self.restarts += 1
            self._start()
        group = self._group
        started = time.perf_counter()
        try:
            replies = group.run(task, timeout, tolerate_deaths)
        # BaseException includes Ctrl-C: show what the ranks printed, then stop them all
        except BaseException:
            replay(group.take_output())
            group.stop()
            raise
        finally:
            if not group.alive:
                group.cleanup()
        outputs = group.take_output()
        replay(outputs)
        results = Results(result for result, _ in replies)
        results.timeline = trace.Timeline(e for _, events in replies for e in events)
        results.outputs = [out for out, _ in outputs]
        results.seconds = time.perf_counter() - started
        return results

    def close(self) -> None:
        """Stop every rank and remove their files; the Cluster cannot run again."""
        self._closed = True
        if self._group is not None:
            self._group.stop(graceful=True)
            self._group.cleanup()
            self._group = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks (empty once closed)."""
        return [p.pid for p in self._group.procs] if self._group else []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # a Cluster dropped without close() must not leave its ranks running
    def __del__(self) -> None:
        group = getattr(self, "_group", None)
        if group is not None:
            group.stop()
            group.cleanup()

    def __repr__(self) -> str:
        state = "running" if self._group and self._group.alive else "stopped"
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device!r}, {state})")


def launch(fn: Callable, world_size: int, *args: Any, backend: str = "auto",
           timeout: float = DEFAULT_TIMEOUT, tolerate_deaths: bool = False,
           device: str = "auto", **kwargs: Any) -> Results:
    """Run `fn(*args, **kwargs)` on `world_size` fresh ranks; return their results in rank order.

    A rank that dies ends the run with a RankError, unless `tolerate_deaths`: then its
    result is a `RankDied` and the others finish (for code written to survive a dead
    peer, as SWARM is). `device="cuda"` with gloo puts the ranks on the GPUs there are,
    several on one card if need be (see `resolve_device`). Under torchrun (RANK and
    WORLD_SIZE set) this process joins that process group and runs `fn` here instead;
    every process gets the full list of results.
    """
    world_size = _check_world_size(world_size)
    timeout = _check_timeout(timeout)
    if under_torchrun():
        return run_under_torchrun(fn, world_size, args, kwargs, backend, timeout, device)
    task = _serialize(fn, args, kwargs)  # fail on bad input before starting processes
    if tolerate_deaths and resolve_backend(backend, world_size) == "nccl":
        # surviving a dead peer reads gloo's error on the broken connection; NCCL hangs or
        # aborts the whole communicator instead
        raise ValueError("tolerate_deaths needs backend='gloo': under NCCL a dead peer hangs "
                         "or aborts every rank's communicator")
    with Cluster(world_size, backend, timeout=timeout, device=device) as cluster:
        return cluster._run(task, timeout, tolerate_deaths)
