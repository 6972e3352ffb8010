"""The launcher's side of one set of ranks: start the processes, collect replies,
and end them all at the first error, death or timeout."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for
from typing import Any

import cloudpickle

from . import progress
from .errors import RankDied, RankError, RankTimeout
from .worker import STARTUP_TIMEOUT, _worker_main, entered_path, where_waiting

# what gloo says on a rank whose peer process has gone
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


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


class RankGroup:
    """The processes of one set of ranks, their pipes and their output files."""

    def __init__(self, size: int, backend: str, start_method: str, threads: int,
                 device: str = "cpu") -> None:
        self.size, self.backend, self.device = size, backend, device
        self.io_dir = tempfile.mkdtemp(prefix="minipar-")
        progress.create(self.io_dir, size)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # imported once in the forkserver; every rank forked from it starts with torch loaded
            ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle",
                                        "minipar.runtime.worker"])
            _start_forkserver_deaf_to_ctrl_c()
        self.conns, self.procs = [], []
        # every rank watches the read end and exits at its end-of-file: when stop() closes
        # the write end, or this process exits
        self._lifeline, self._lifeline_w = ctx.Pipe(duplex=False)
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
                               args=(r, self.size, self.backend, self.device,
                                     self.io_dir, self._lifeline, threads, child_end))
            self.conns.append(parent_end)
            self.procs.append(proc)  # before start: stop() ends it even if start is cut short
            with _ctrl_c_held():
                proc.start()
            # keep only our end: once the rank's end is closed here too, its death reads as EOF
            child_end.close()

    def run(self, task: bytes, timeout: float, tolerate_deaths: bool = False) -> list:
        sent = time.monotonic()
        for conn in self.conns:
            conn.send_bytes(task)
        return self._collect(timeout, tolerate_deaths=tolerate_deaths, sent=sent)

    def _entered(self, r: int, sent: float) -> float | None:
        """When rank r entered this task's function, or None if it has not yet."""
        try:
            with open(entered_path(self.io_dir, r)) as f:
                at = float(f.read() or "nan")
        except (OSError, ValueError):
            return None
        return at if at >= sent else None  # an older time is the last task's

    def _budget_end(self, pending: set[int], timeout: float, sent: float) -> float:
        """The timeout is a watchdog on progress: it counts from the last time any rank
        made progress (runtime/progress.py), or entered the function, not from when the
        task was sent: on a busy machine unpickling it and the barrier before it may take
        seconds. A rank that never enters gets STARTUP_TIMEOUT more before it is called stuck."""
        entered = [self._entered(r, sent) for r in pending]
        if None not in entered:
            return max(*entered, progress.latest(self.io_dir, self.size)) + timeout
        if time.monotonic() < sent + timeout + STARTUP_TIMEOUT:
            return time.monotonic() + 0.5  # not in the function yet: look again soon
        return sent + timeout  # stuck before the function: time out now

    def _collect(self, timeout: float, starting: bool = False,
                 tolerate_deaths: bool = False, sent: float | None = None) -> list:
        """Wait for every rank's reply; the first error or death ends the group (with
        `tolerate_deaths` a death leaves a RankDied reply and the others go on)."""
        replies: list = [None] * self.size
        pending = set(range(self.size))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and sent is not None:
                deadline = self._budget_end(pending, timeout, sent)
                remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = self._where_waiting(pending)
                self.stop()
                if starting:
                    raise RankError(min(pending), f"did not join the process group within "
                                    f"{timeout:g}s ({waiting[min(pending)]})")
                raise RankTimeout(timeout, waiting)
            handles = {self.conns[r]: r for r in pending}
            # a process's sentinel becomes ready when it exits: a death is noticed without a reply
            handles.update({self.procs[r].sentinel: r for r in pending})
            for handle in wait_for(list(handles), timeout=min(remaining, 1.0)):
                r = handles[handle]
                if r not in pending:
                    continue
                # a rank may reply and then exit: read a waiting reply before calling it dead
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
                    if tolerate_deaths:
                        replies[r] = (RankDied(r, code), [])
                        pending.discard(r)
                        continue
                    self._raise_death(r)
                if status == "error":
                    if not tolerate_deaths and any(words in value for words in PEER_GONE):
                        dead = self._dead_peer(pending - {r})
                        if dead is not None:  # report the cause, not its echo
                            self._raise_death(dead)
                    self.stop()
                    raise RankError(r, f"raised {value.strip().splitlines()[-1]}", value)
                replies[r] = value
                pending.discard(r)
        return replies

    def _dead_peer(self, ranks: set[int]) -> int | None:
        """A rank among `ranks` whose process has exited (waiting briefly: a peer's
        "connection closed" error arrives as the dead rank's process goes)."""
        sentinels = {self.procs[r].sentinel: r for r in ranks}
        for handle in wait_for(list(sentinels), timeout=0.5):
            return sentinels[handle]
        return None

    def _raise_death(self, r: int) -> None:
        self.procs[r].join(timeout=1.0)
        code = self.procs[r].exitcode
        self.stop()
        stderr = self.take_output()[r][1].strip()
        raise RankError(r, f"exited with code {code} before returning (crashed or killed)"
                        + (f"\nits last output:\n{stderr[-2000:]}" if stderr else ""))

    def _where_waiting(self, ranks: set[int]) -> dict[int, str]:
        """Ask each rank for its stack (SIGUSR1) and read where it waits; a rank on a
        busy machine gets up to 3 s to write it."""
        if not hasattr(signal, "SIGUSR1"):
            return {r: "still running" for r in ranks}
        paths = {r: os.path.join(self.io_dir, f"{r}.stack") for r in ranks}

        def size(r: int) -> int:
            return os.path.getsize(paths[r]) if os.path.exists(paths[r]) else 0

        before = {r: size(r) for r in ranks}
        asked = {r for r in ranks if self.procs[r].is_alive()}
        for r in asked:
            # the worker registered faulthandler on SIGUSR1: it appends its stack to the .stack file
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(size(r) == before[r] for r in asked):
            time.sleep(0.05)
        time.sleep(0.05)  # let a dump that has started finish
        found = {}
        for r in ranks:
            try:
                with open(paths[r]) as f:
                    f.seek(before[r])
                    found[r] = where_waiting(f.read())
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
                        # only what was printed since the last call (the files grow across runs)
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
            # a rank waiting in recv_bytes reads end-of-file and leaves its loop
            conn.close()
        started = [proc for proc in self.procs if proc.pid is not None]
        if graceful:
            deadline = time.monotonic() + 2.0
            for proc in started:
                proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        for proc in started:
            if proc.is_alive():
                proc.kill()
        self._lifeline_w.close()  # and any rank whose start was cut short leaves by itself
        self._lifeline.close()
        for proc in started:
            proc.join(timeout=2.0)
        self.conns, self.procs = [], []
        _live_groups.discard(self)

    def cleanup(self) -> None:
        shutil.rmtree(self.io_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return bool(self.procs)


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside this block and raise it at its end. Starting a
    rank hands it its start-up data through a pipe: cut off halfway, the rank prints an
    EOFError traceback of its own. Only the main thread may set handlers; elsewhere, as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, None)  # the handler that was there: KeyboardInterrupt, usually


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start multiprocessing's forkserver (if it is not running) with SIGINT blocked, a
    signal mask that it and the ranks it forks inherit (through exec and fork). Ctrl-C in a
    terminal reaches every process of the foreground group: the launcher turns it into one
    line and stops the ranks, and the forkserver, importing torch for a second or two, would
    otherwise print a traceback of its own. Blocked, not ignored: an ignored SIGINT here
    would be lost to the launcher too; blocked in this thread only, it is held for it."""
    import multiprocessing.forkserver as forkserver
    from multiprocessing import resource_tracker

    # started first, on its own: it blocks and then *unblocks* SIGINT around its own start
    resource_tracker.ensure_running()
    if threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "pthread_sigmask"):
        forkserver.ensure_running()
        return
    with _ctrl_c_held():
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# weak: tracking a group for the exit handler must not keep a dropped group alive
_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()


@atexit.register
def _stop_all_groups() -> None:
    for group in list(_live_groups):
        group.stop()
        group.cleanup()


def replay(outputs: list[tuple[str, str]]) -> None:
    """Print every rank's output in rank order, each line prefixed with its rank."""
    for stream_index, stream in ((0, sys.stdout), (1, sys.stderr)):
        text = "".join(f"[rank {r}] {line}\n"
                       for r, pair in enumerate(outputs)
                       for line in pair[stream_index].splitlines())
        if text:
            stream.write(text)
            stream.flush()
