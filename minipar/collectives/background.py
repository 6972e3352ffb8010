"""Communication in the background: one thread per trainer that runs collectives in the
order they were submitted, while the main thread computes.

Collectives match across ranks only if every rank issues them in the same order, so a
trainer never calls them from two threads at once: while a CommThread is busy, all of
that trainer's communication goes through it, and `join()` waits for it before the main
thread talks again. A job's exception is kept in its Future (raised where its result is
asked for) and raised again by the next `join()`, so no failure goes unnoticed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..runtime.device import thread_checks


class CommThread:
    """A FIFO of communication jobs run by one daemon thread, started on first use."""

    def __init__(self, name: str = "minipar-comm") -> None:
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failures: list[BaseException] = []

    def submit(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` after every job submitted before it; its Future holds the result."""
        if self._thread is None:
            # daemon: a thread blocked in a collective must not keep the rank from exiting
            self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
            self._thread.start()
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def join(self) -> None:
        """Wait until every submitted job has finished; raise the first failure since the
        last join."""
        self._queue.join()
        if self._failures:
            failure, self._failures = self._failures[0], []
            raise failure

    def _run(self) -> None:
        # on the faked device, this thread's host reads are checked too (runtime/
        # faked_device.py: its checks of Python-level ops live in a per-thread mode)
        thread_checks().__enter__()
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # raised on the main thread: result() or join()
                future.set_exception(err)
                self._failures.append(err)
            finally:
                self._queue.task_done()  # in finally: join() must never wait for a failed job
