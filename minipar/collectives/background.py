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
compute work queued when it was submitted, and the tensors it is given are recorded as
used by its stream; its result, read with `result()`, is handed over to the reader's
stream, and after `join()` the joining stream waits for every job. Neither blocks the
host. A tensor a job makes and leaves behind (a gradient shard it stores) is its own
to hand over: `used_by_submitter`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..runtime.device import device, on_accelerator, thread_checks
from ..runtime.streams import (
    compute_ready,
    current_stream,
    handed_over,
    on_stream,
    side_stream,
    used_on,
)

_job = threading.local()  # on a CommThread: the stream that submitted the running job


def used_by_submitter(value: object) -> None:
    """Inside a job: the tensors in `value`, made on the job's stream and kept after it,
    are used by the stream that submitted the job (`record_stream`), so their memory is
    not reused while that stream still reads them. A no-op elsewhere and on CPU."""
    used_on(value, getattr(_job, "submitter", None))


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
        self._finished: object | None = None  # the last job's event that `join` waits for
        self._stream: object | None = None

    def submit(self, fn: Callable, *args) -> JobFuture:
        """Run `fn(*args)` after every job submitted before it, and after the compute work
        queued so far; its Future holds the result."""
        if self._thread is None:
            # daemon: a thread blocked in a collective must not keep the rank from exiting
            self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
            self._thread.start()
        future = JobFuture()
        self._queue.put((future, fn, args, compute_ready(), current_stream()))
        return future

    def join(self) -> None:
        """Wait until every submitted job has finished, and hand their work over to this
        thread's stream; raise the first failure since the last join."""
        self._queue.join()
        # one stream runs the jobs in order: waiting for the last waits for them all
        finished, self._finished = self._finished, None
        handed_over(None, finished)
        if self._failures:
            failure, self._failures = self._failures[0], []
            raise failure

    def _run(self) -> None:
        # on the faked device, this thread's host reads are checked too (runtime/
        # faked_device.py: its checks of Python-level ops live in a per-thread mode)
        thread_checks().__enter__()
        while True:
            future, fn, args, ready, submitter = self._queue.get()
            try:
                stream = self._stream_now()
                _job.submitter = submitter
                with on_stream(stream, ready):
                    used_on(args, stream)  # compute's tensors, read on this stream
                    result = fn(*args)
                    future.finished = compute_ready()  # recorded on this thread's stream
                if future.finished is not None:
                    self._finished = future.finished
                future.set_result(result)
            except BaseException as err:  # raised on the main thread: result() or join()
                future.set_exception(err)
                self._failures.append(err)
            finally:
                _job.submitter = None
                self._queue.task_done()  # in finally: join() must never wait for a failed job

    def _stream_now(self) -> object | None:
        """This thread's stream on the rank's device today (ranks outlive a task, and the
        next task may compute elsewhere: the faked device, the CPU)."""
        if not on_accelerator():
            return None
        if self._stream is None or self._stream.device != device():
            self._stream = side_stream()
        return self._stream
