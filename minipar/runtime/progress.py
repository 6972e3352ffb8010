"""Progress: the heartbeat the launcher's watchdog reads.

A run's timeout is a watchdog on progress, not a budget for the whole run: the
launcher calls the run stuck only when no rank has made progress (a message, a
collective, a recorded computation, a training step) for `timeout` seconds. A healthy
run of any length is never killed, while a deadlock still ends within the window.

Each rank writes, at every beat, the time (time.monotonic: one clock for every process
on the machine) into its slot of a small memory-mapped file in the group's folder, a
store of a few nanoseconds; the launcher reads the file.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

_SLOT = struct.Struct("d")
_view: mmap.mmap | None = None
_rank = 0


def path(io_dir: str) -> str:
    return os.path.join(io_dir, "progress")


def create(io_dir: str, size: int) -> None:
    """The launcher makes the file, one slot per rank, before the ranks start."""
    with open(path(io_dir), "wb") as f:
        f.write(b"\0" * _SLOT.size * size)


def attach(io_dir: str, rank: int) -> None:
    """A rank maps the file, to beat into its slot."""
    global _view, _rank
    with open(path(io_dir), "r+b") as f:
        _view = mmap.mmap(f.fileno(), 0)
    _rank = rank


def beat() -> None:
    """This rank has made progress (no-op outside a launched rank)."""
    if _view is not None:
        _SLOT.pack_into(_view, _SLOT.size * _rank, time.monotonic())


def latest(io_dir: str, size: int) -> float:
    """The launcher's side: the last time any rank made progress (0 before any did)."""
    try:
        with open(path(io_dir), "rb") as f:
            data = f.read(_SLOT.size * size)
    except OSError:
        return 0.0
    return max((_SLOT.unpack_from(data, _SLOT.size * r)[0]
                for r in range(len(data) // _SLOT.size)), default=0.0)
