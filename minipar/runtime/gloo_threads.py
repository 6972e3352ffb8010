"""gloo's socket threads must not preempt the thread whose lock they wait for.

gloo, torch's CPU backend, gives each process group a thread (named `gloo_tcp_loop`)
that waits in epoll for the group's sockets and reads what arrives. To touch a
connection it takes that connection's lock with a try-lock; when another thread holds
it (the rank's own thread, posting a send or a receive), it gives up and goes back to
epoll, which reports the same event at once: it spins until the lock is free
(`Pair::handleEvents` in gloo's tcp/pair.cc says so).

On Linux a thread that wakes up may preempt the one running on its core. With ranks
on busy cores (as in training, or one rank bound per core), the loop thread wakes as
a message lands, preempts the very thread that holds the lock, and spins until the
scheduler's next tick (4 ms at 250 Hz) lets the holder finish. A two-rank ring
all-reduce of three numbers, each rank bound to a core, took 4.0 ms instead of 0.3 ms; a
training step paid it on every reduction its rank waited for.

The fix is a scheduling class, not a change to gloo: SCHED_BATCH. The kernel never lets
a waking SCHED_BATCH thread preempt the running one (its turn comes when that thread
sleeps, say in the wait for this very message, or at the next tick), and at nice 0 it
keeps its full share of the core. Each group starts a loop thread of its own, so ranks
make their groups inside `calm_from_birth` (start-up does; `new_groups`, minipar's one way
to make groups after start-up, does too), and `calm_gloo_threads` moves those made
elsewhere.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from .device import rank

LOOP_THREAD = "gloo_tcp_loop"  # the name gloo gives its epoll thread (tcp/loop.cc)


def calm_gloo_threads() -> int:
    """Move this process's gloo loop threads to SCHED_BATCH (see the module docstring);
    returns how many it moved. Does nothing where the platform has no SCHED_BATCH or
    no /proc (macOS) and skips threads that end while it looks."""
    if not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"):
        return 0
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != LOOP_THREAD:
                    continue
            if os.sched_getscheduler(int(tid)) != os.SCHED_BATCH:
                # per thread: Linux takes a thread id where the call names a process
                os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
                moved += 1
        except OSError:  # the thread ended (a destroyed group's), or a sandbox refuses
            continue
    return moved


@contextmanager
def calm_from_birth() -> Iterator[None]:
    """Inside, every thread this thread starts is SCHED_BATCH from its first instant: Linux
    copies the creator's policy into a new thread. (A loop thread names itself only when
    it first runs, so on a busy machine a scan right after the group is made could find it
    still unnamed and pass it by: a loaded CI run saw one.) The creating thread gets its
    own policy back after the block; then `calm_gloo_threads` runs for threads started
    elsewhere."""
    tid, kept = threading.get_native_id(), None
    try:
        own = os.sched_getscheduler(tid), os.sched_getparam(tid)
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        kept = own  # to give back: only once it was changed
    except (AttributeError, OSError):  # no SCHED_BATCH (macOS), or a sandbox refuses
        pass
    try:
        yield
    finally:
        if kept is not None:
            os.sched_setscheduler(tid, *kept)
        calm_gloo_threads()


def new_groups(partition: Iterable[list[int]]) -> dist.ProcessGroup | None:
    """Make one process group for each rank list in `partition` and return this rank's
    (None where it is in none). Every rank calls it with the same lists in the same
    order: torch's `new_group` is collective, every process creates every group, members
    or not, or the group ids disagree across ranks. The new groups' loop threads are
    calm from birth (`calm_from_birth`)."""
    me, mine = rank(), None
    with calm_from_birth():
        for ranks in partition:
            members = list(ranks)
            group = dist.new_group(members)
            if me in members:
                mine = group
    return mine
