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
- Rendezvous uses a TCPStore that the caller hosts on loopback with a port the OS
  picks, so parallel runs never collide on a fixed port.
- Each rank writes stdout/stderr to its own file; the caller replays them after the
  run, in rank order, each line prefixed ``[rank r]``, so notebooks and nbval see the
  same text every run.
- Failure is loud and fast: the first rank that raises ends the whole group and the
  caller gets a `RankError` with that rank's traceback. A run that passes its
  timeout ends with a `RankTimeout` naming, for each rank still running, the call it
  was blocked in (read from a faulthandler stack dump). No process outlives its run
  or its Cluster: ranks also kill themselves if the calling process disappears.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import faulthandler
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import trace

BACKENDS = ("auto", "gloo", "nccl")
START_METHODS = ("forkserver", "spawn")
DEFAULT_TIMEOUT = 120.0
STARTUP_TIMEOUT = 60.0
_HOST = "127.0.0.1"
_TASK_FRAME = "_run_task"  # the worker frame that calls the user's function

# ---------------------------------------------------------------- device helper ---
# The one place that touches torch.cuda: everything else asks these functions.

_device = torch.device("cpu")
_in_rank = False  # True inside a process started by minipar


def gpu_count() -> int:
    """Number of visible CUDA GPUs (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, ranks_per_machine: int) -> str:
    """Turn "auto" into "nccl" (one GPU per rank available) or "gloo"; check the others."""
    if backend not in BACKENDS:
        allowed = ", ".join(map(repr, BACKENDS))
        raise ValueError(f"backend must be one of {allowed}; got {backend!r}")
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= ranks_per_machine and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and (gpus < ranks_per_machine or not dist.is_nccl_available()):
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_per_machine} ranks but {gpus} GPUs "
            "visible (or NCCL is missing from this torch build); use backend='gloo' to run on "
            "CPU processes, or backend='auto' to pick for you")
    return backend


def _bind_device(backend: str, local_rank: int) -> None:
    global _device
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        _device = torch.device("cuda", local_rank)
    else:
        _device = torch.device("cpu")


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    return _device


def synchronize() -> None:
    """Wait for queued GPU work on this rank's device (a no-op on CPU); use before timing."""
    if _device.type == "cuda":
        torch.cuda.synchronize(_device)


def rank() -> int:
    """This process's rank (0 outside any launch)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks in the run (1 outside any launch)."""
    return dist.get_world_size() if dist.is_initialized() else 1


# --------------------------------------------------------------------- errors ---

class RankError(RuntimeError):
    """A rank raised (or died); carries the rank and its remote traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        text = f"rank {rank} {message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RankTimeout(TimeoutError):
    """A run passed its timeout; `waiting` maps each unfinished rank to where it was."""

    def __init__(self, timeout: float, waiting: dict[int, str]) -> None:
        self.waiting = waiting
        lines = [f"run did not finish within timeout={timeout:g}s; "
                 f"{len(waiting)} rank(s) were still waiting (a deadlock or a slow rank):"]
        lines += [f"  rank {r}: {where}" for r, where in sorted(waiting.items())]
        lines.append("If the run is just slow, pass a larger timeout=.")
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------- results ---

class Results(list):
    """Per-rank return values in rank order; `.timeline` and `.outputs` tell what happened."""

    timeline: trace.Timeline
    outputs: list[str]
    seconds: float


# ------------------------------------------------------------- input checking ---

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
        return cloudpickle.dumps((fn, args, kwargs, list(sys.path)))
    except Exception as err:
        raise TypeError(
            f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
            f"{type(err).__name__}: {err}. The function, its arguments and the globals it "
            "uses must be picklable: create locks, open files, sockets or generators inside "
            "the function instead of capturing them") from None


def _torchrun_env() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not _in_rank


# ---------------------------------------------------------------- the worker ---

def _die_with_parent(launcher_pid: int) -> None:
    """End this rank if the launching process goes away, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(launcher_pid, 0)
            except OSError:
                os._exit(1)

    threading.Thread(target=watch, name="minipar-parent-watch", daemon=True).start()


def _redirect_output(out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)


def _flush_output() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)  # C++ prints from torch/gloo
    except (OSError, AttributeError):
        pass


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code down, without the worker's own frames."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None \
            and tb.tb_frame.f_code.co_name in ("_worker_main", _TASK_FRAME):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


def _run_task(task: bytes) -> tuple:
    fn, args, kwargs, path = cloudpickle.loads(task)
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    dist.barrier()  # a common t=0 for every rank's events
    with trace.capture(rank()) as captured:
        result = fn(*args, **kwargs)
    return result, captured.events


def _worker_main(rank_: int, size: int, backend: str, port: int, io_dir: str,
                 launcher_pid: int, threads: int, conn: Any) -> None:
    global _in_rank
    _in_rank = True
    _redirect_output(os.path.join(io_dir, f"{rank_}.out"), os.path.join(io_dir, f"{rank_}.err"))
    stack_file = open(os.path.join(io_dir, f"{rank_}.stack"), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _die_with_parent(launcher_pid)
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(size), LOCAL_RANK=str(rank_),
                      LOCAL_WORLD_SIZE=str(size))
    if backend == "gloo":
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # already fixed in this process
            pass
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    try:
        _bind_device(backend, rank_)
        store = dist.TCPStore(_HOST, port, None, False, datetime.timedelta(seconds=STARTUP_TIMEOUT))
        dist.init_process_group(backend, store=store, rank=rank_, world_size=size,
                                timeout=datetime.timedelta(hours=1))
        conn.send_bytes(cloudpickle.dumps(("ready", None)))
    except BaseException:
        conn.send_bytes(cloudpickle.dumps(("error", traceback.format_exc())))
        _flush_output()
        os._exit(1)
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            result, events = _run_task(task)
            try:
                reply = cloudpickle.dumps(("ok", (result, events)))
            except Exception as err:
                raise TypeError(f"the return value of rank {rank_} cannot be pickled "
                                f"({err}); return tensors, numbers or plain containers") from None
        except BaseException as err:
            reply = cloudpickle.dumps(("error", _user_traceback(err)))
        _flush_output()
        conn.send_bytes(reply)
    _flush_output()
    os._exit(0)  # skip interpreter teardown: nothing is left to flush


# ------------------------------------------------------------- the launcher side ---

def _where_waiting(stack_dump: str) -> str:
    """Summarize a faulthandler dump: the innermost call, and the user's line that led to it."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack_dump)
    block = next((b for b in reversed(blocks) if _TASK_FRAME in b), "")
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
    if not frames:
        return "still running (no stack available)"
    inner_file, inner_line, inner_fn = frames[0]  # faulthandler lists the innermost first
    depth = next((i for i, frame in enumerate(frames) if frame[2] == _TASK_FRAME), len(frames))
    library = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    users = [f for f in frames[:depth] if not f[0].startswith(library)]
    user = users[0] if users else frames[max(depth - 1, 0)]
    where = f"in {inner_fn}() at {os.path.basename(inner_file)}:{inner_line}"
    if user != frames[0]:
        where += f", called from {user[2]}() at {os.path.basename(user[0])}:{user[1]}"
    return where


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Keep multiprocessing from re-running the caller's script in every rank.

    Functions reach the ranks by value, so ranks never need `__main__`; hiding it
    means a script without an ``if __name__ == "__main__"`` guard does not launch
    itself again in each rank, and slow top-level code does not run K more times.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__} \
        if main is not None else {}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


class _RankGroup:
    """The processes of one set of ranks, their pipes and their output files."""

    def __init__(self, size: int, backend: str, start_method: str, threads: int) -> None:
        self.size, self.backend = size, backend
        self.io_dir = tempfile.mkdtemp(prefix="minipar-")
        self.store = dist.TCPStore(_HOST, 0, None, True,
                                   datetime.timedelta(seconds=STARTUP_TIMEOUT),
                                   wait_for_workers=False)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle",
                                        "minipar.runtime"])
        self.conns, self.procs = [], []
        self.offsets = [[0, 0] for _ in range(size)]
        _live_groups.add(self)
        try:
            self._start_ranks(ctx, threads)
            self._collect(STARTUP_TIMEOUT, starting=True)
        except BaseException:
            self.stop()
            self.cleanup()
            raise

    def _start_ranks(self, ctx: Any, threads: int) -> None:
        with _main_module_hidden():
            self._start_processes(ctx, threads)

    def _start_processes(self, ctx: Any, threads: int) -> None:
        for r in range(self.size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, name=f"minipar-rank-{r}",
                               args=(r, self.size, self.backend, self.store.port,
                                     self.io_dir, os.getpid(), threads, child_end))
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def run(self, task: bytes, timeout: float) -> list:
        for conn in self.conns:
            conn.send_bytes(task)
        return self._collect(timeout)

    def _collect(self, timeout: float, starting: bool = False) -> list:
        """Wait for every rank's reply; the first error or death ends the group."""
        replies: list = [None] * self.size
        pending = set(range(self.size))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = self._where_waiting(pending)
                self.stop()
                if starting:
                    raise RankError(min(pending), f"did not join the process group within "
                                    f"{timeout:g}s ({waiting[min(pending)]})")
                raise RankTimeout(timeout, waiting)
            handles = {self.conns[r]: r for r in pending}
            handles.update({self.procs[r].sentinel: r for r in pending})
            for handle in wait_for(list(handles), timeout=min(remaining, 1.0)):
                r = handles[handle]
                if r not in pending:
                    continue
                if handle is self.conns[r] or self.conns[r].poll():
                    try:
                        status, value = cloudpickle.loads(self.conns[r].recv_bytes())
                    except (EOFError, OSError):
                        status, value = "died", None
                else:
                    status, value = "died", None
                if status == "died":
                    self.procs[r].join(timeout=1.0)
                    code = self.procs[r].exitcode
                    self.stop()
                    stderr = self.take_output()[r][1].strip()
                    raise RankError(r, f"exited with code {code} before returning "
                                    "(crashed or killed)"
                                    + (f"; its last output:\n{stderr[-2000:]}" if stderr else ""))
                if status == "error":
                    self.stop()
                    raise RankError(r, f"raised {value.strip().splitlines()[-1]}", value)
                replies[r] = value
                pending.discard(r)
        return replies

    def _where_waiting(self, ranks: set[int]) -> dict[int, str]:
        if not hasattr(signal, "SIGUSR1"):
            return {r: "still running" for r in ranks}
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        found = {}
        for r in ranks:
            try:
                with open(os.path.join(self.io_dir, f"{r}.stack")) as f:
                    found[r] = _where_waiting(f.read())
            except OSError:
                found[r] = "still running (no stack available)"
        return found

    def take_output(self) -> list[tuple[str, str]]:
        """What each rank printed since the last call: (stdout, stderr) per rank."""
        taken = []
        for r in range(self.size):
            pair = []
            for i, ext in enumerate(("out", "err")):
                try:
                    with open(os.path.join(self.io_dir, f"{r}.{ext}"), "rb") as f:
                        f.seek(self.offsets[r][i])
                        data = f.read()
                except OSError:
                    data = b""
                self.offsets[r][i] += len(data)
                pair.append(data.decode("utf-8", errors="replace"))
            taken.append(tuple(pair))
        return taken

    def stop(self, graceful: bool = False) -> None:
        """End every rank; graceful lets them leave their loop first."""
        for conn in self.conns:
            conn.close()
        if graceful:
            deadline = time.monotonic() + 2.0
            for proc in self.procs:
                proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=2.0)
        self.conns, self.procs = [], []
        _live_groups.discard(self)

    def cleanup(self) -> None:
        shutil.rmtree(self.io_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return bool(self.procs)


_live_groups: weakref.WeakSet[_RankGroup] = weakref.WeakSet()


@atexit.register
def _stop_all_groups() -> None:
    for group in list(_live_groups):
        group.stop()
        group.cleanup()


def _replay(outputs: list[tuple[str, str]]) -> None:
    """Print every rank's output in rank order, each line prefixed with its rank."""
    for stream_index, stream in ((0, sys.stdout), (1, sys.stderr)):
        text = "".join(f"[rank {r}] {line}\n"
                       for r, pair in enumerate(outputs)
                       for line in pair[stream_index].splitlines())
        if text:
            stream.write(text)
            stream.flush()


class Cluster:
    """Ranks kept alive between runs: ``with Cluster(4) as c: c.run(fn)``.

    Each `run` sends the function to every rank and returns the per-rank results in
    rank order. If a run fails (a rank raises, dies or times out) every rank is
    stopped and the next `run` starts fresh ones (state kept in the ranks is lost).
    """

    def __init__(self, world_size: int, backend: str = "auto", *,
                 timeout: float = DEFAULT_TIMEOUT, threads_per_rank: int = 1,
                 start_method: str | None = None) -> None:
        self.world_size = _check_world_size(world_size)
        self.timeout = _check_timeout(timeout)
        if start_method is None:
            start_method = "forkserver" if hasattr(os, "fork") else "spawn"
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}; got {start_method!r}")
        if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) \
                or threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be an int >= 1; got {threads_per_rank!r}")
        self.start_method, self.threads_per_rank = start_method, threads_per_rank
        self.backend = resolve_backend(backend, self.world_size)
        self.restarts = 0
        self._closed = False
        self._group: _RankGroup | None = None
        if _in_rank:
            raise RuntimeError("minipar cannot start ranks from inside a rank; "
                               "call launch()/Cluster() from the main process")
        self._start()

    def _start(self) -> None:
        self._group = None
        self._group = _RankGroup(self.world_size, self.backend, self.start_method,
                                 self.threads_per_rank)

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> Results:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        task = _serialize(fn, args, kwargs)
        return self._run(task, self.timeout if timeout is None else _check_timeout(timeout))

    def _run(self, task: bytes, timeout: float) -> Results:
        if self._closed:
            raise RuntimeError("this Cluster is closed; create a new minipar.Cluster to run more")
        if self._group is None or not self._group.alive:
            self.restarts += 1
            self._start()
        group = self._group
        started = time.perf_counter()
        try:
            replies = group.run(task, timeout)
        except BaseException:
            _replay(group.take_output())
            group.stop()
            raise
        finally:
            if not group.alive:
                group.cleanup()
        outputs = group.take_output()
        _replay(outputs)
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

    def __del__(self) -> None:
        group = getattr(self, "_group", None)
        if group is not None:
            group.stop()
            group.cleanup()

    def __repr__(self) -> str:
        state = "running" if self._group and self._group.alive else "stopped"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"


def launch(fn: Callable, world_size: int, *args: Any, backend: str = "auto",
           timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> Results:
    """Run `fn(*args, **kwargs)` on `world_size` fresh ranks; return their results in rank order.

    Under torchrun (RANK and WORLD_SIZE set) this process joins that process group
    and runs `fn` here instead; every process gets the full list of results.
    """
    world_size = _check_world_size(world_size)
    timeout = _check_timeout(timeout)
    if _torchrun_env():
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout)
    task = _serialize(fn, args, kwargs)  # fail on bad input before starting processes
    with Cluster(world_size, backend, timeout=timeout) as cluster:
        return cluster._run(task, timeout)


def demo_parser(description: str, default_ranks: int = 2) -> argparse.ArgumentParser:
    """The options every `python -m minipar.<technique>` demo shares: --ranks (torchrun's
    WORLD_SIZE when set) and --backend. Modules add their own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int,
                        default=int(os.environ.get("WORLD_SIZE", default_ranks)))
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    return parser


def _leave_process_group() -> None:
    """Destroy the group minipar joined under torchrun before the interpreter exits
    (left to exit-time destructors, gloo's threads can abort the process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run_under_torchrun(fn: Callable, size: int, args: tuple, kwargs: dict, backend: str,
                        timeout: float) -> Results:
    env_size = int(os.environ["WORLD_SIZE"])
    if size != env_size:
        raise ValueError(f"world_size={size} but torchrun started {env_size} processes; "
                         f"pass world_size={env_size} (or minipar.world_size())")
    if not dist.is_initialized():
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        backend = resolve_backend(backend, local_size)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        _bind_device(backend, local_rank)
        if backend == "gloo":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout, 60)))
        atexit.register(_leave_process_group)
    started = time.perf_counter()
    dist.barrier()
    with trace.capture(rank()) as captured:
        result = fn(*args, **kwargs)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (result, captured.events))
    results = Results(r for r, _ in gathered)
    results.timeline = trace.Timeline(e for _, events in gathered for e in events)
    results.outputs = [""] * size  # under torchrun, ranks print directly
    results.seconds = time.perf_counter() - started
    return results
