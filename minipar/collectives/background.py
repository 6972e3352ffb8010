"""Communication in the background: one thread per trainer that runs collectives in the
order they were submitted, while the main thread computes.

Collectives match across ranks only if every rank issues them in the same order, so a
trainer never calls them from two threads at once: while a CommThread is busy, all of
that trainer's communication goes through it, and `join()` waits for it before the main
thread talks again. A job's exception is kept in its Future (raised where its result is
asked for) and raised again by the next `join()`, so no failure goes unnoticed.

On a GPU the thread queues its work on a stream of its own (runtime/streams.py), as
torch's DDP reducer does: on the compute stream, a collective would wait behind every
kernel queued before it, and no communication would overlap. A job starts after the
compute work queued when it was submitted; its result, read with `result()`, or every
job's after `join()`, is handed over to the reader's stream. Neither blocks the host.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..runtime.device import thread_checks
from ..runtime.streams import compute_ready, handed_over, on_stream, side_stream


class JobFuture(Future):
    """A job's Future: `result()` hands the result over to the reader's stream (a no-op
    on CPU). `finished` is the event the job's stream recorded when it was done."""

    finished: object | None = None

    def result(self, timeout: float | None = None):
        return handed_over(super().result(timeout), self.finished)


class CommThread:
    """A FIFO of communication jobs run by one daemon thread, started on first use."""

    def __init__(self, name: str = "minipar-comm") -> None:
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failures: list[BaseException] = []
        self._last: JobFuture | None = None

    def submit(self, fn: Callable, *args) -> JobFuture:
        """Run `fn(*args)` after every job submitted before it, and after the compute work
        queued so far; its Future holds the result."""
        if self._thread is None:
            # daemon: a thread blocked in a collective must not keep the rank from exiting
            self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
            self._thread.start()
        future = JobFuture()
        self._queue.put((future, fn, args, compute_ready()))
        self._last = future
        return future

    def join(self) -> None:
        """Wait until every submitted job has finished, and hand their work over to this
        thread's stream; raise the first failure since the last join."""
        self._queue.join()
        if self._last is not None:
            # one stream runs the jobs in order: waiting for the last waits for them all
            handed_over(None, self._last.finished)
            self._last = None
        if self._failures:
            failure, self._failures = self._failures[0], []
            raise failure

    def _run(self) -> None:
        # on the faked device, this thread's host reads are checked too (runtime/
        # faked_device.py: its checks of Python-level ops live in a per-thread mode)
        thread_checks().__enter__()
        stream = side_stream()
        while True:
            future, fn, args, ready = self._queue.get()
            try:
                with on_stream(stream, ready):
                    result = fn(*args)
                    future.finished = compute_ready()  # recorded on this thread's stream
                future.set_result(result)
            except BaseException as err:  # raised on the main thread: result() or join()
                future.set_exception(err)
                self._failures.append(err)
            finally:
                self._queue.task_done()  # in finally: join() must never wait for a failed job
