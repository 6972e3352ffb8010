"""Streams: where a rank's GPU work queues, and how two queues hand tensors over.

A GPU runs the work each CUDA stream holds in order, and streams side by side. The
compute of a rank runs on its current stream; minipar's background threads (the
communication thread of DDP, ZeRO-2 and FSDP, the copy thread of offloading) each queue
their work on a stream of their own, or their collectives would wait behind every kernel
the compute stream holds, and nothing would overlap. torch's DDP reducer does the same.

Two rules keep two streams correct, and this file is where minipar keeps them:
- **Events order them.** A job reads what compute wrote: its stream waits for an event
  recorded on the compute stream when the job was submitted (`compute_ready`). Compute
  reads what a job wrote: the compute stream waits for an event recorded on the job's
  stream when it finished (`handed_over`). Neither wait blocks the host.
- **`record_stream` tells the allocator.** A tensor made on one stream and used on
  another must not be reused by its own stream's allocations until the other's work is
  done: `handed_over` records the receiving stream on each tensor it hands over.

On a CPU there are no streams: work is done when its call returns, every function here
does nothing, and the thread that runs a job stands for its stream. On the faked device
(faked_device.py) the streams and events are real objects that keep which waited on
what, so tests check the rules on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten

from .. import trace
from . import faked_device
from .device import _accelerator, device, on_accelerator

_copy_stream = None  # this rank's stream for host<->device copies, made on first use


def compute_ready() -> object | None:
    """A mark after the work queued so far on this thread's current stream (a CUDA event)
    for another stream to wait for; None on CPU, where that work is done already."""
    if not on_accelerator():
        return None
    event = _accelerator().Event()
    event.record()
    return event


def side_stream() -> object | None:
    """A stream of its own on this rank's device, for a background thread (None on CPU)."""
    if not on_accelerator():
        return None
    accelerator = _accelerator()
    # the thread's device first: entering a stream on a thread that never set one would
    # make device 0 current there, and CUDA would open a context on GPU 0
    accelerator.set_device(device())
    return accelerator.Stream(device())


@contextmanager
def on_stream(stream: object | None, ready: object | None = None) -> Iterator[None]:
    """Queue the block's work on `stream`, after the work `ready` marks (from
    `compute_ready`). On CPU (`stream` None) the block just runs."""
    if stream is None:
        yield
        return
    accelerator = _accelerator()
    accelerator.set_device(device())
    with accelerator.stream(stream):
        if ready is not None:
            # the job reads what compute wrote, or writes memory compute freed: wait for it
            stream.wait_event(ready)
        yield


def current_stream() -> object | None:
    """This thread's current stream on the rank's device (None on CPU)."""
    return _accelerator().current_stream(device()) if on_accelerator() else None


def used_on(value: object, stream: object | None) -> None:
    """Tell the caching allocator that each device tensor in `value` is used by `stream`
    (`record_stream`): when the tensor is freed, its memory is not handed out again until
    the work `stream` holds by then is done. A no-op on CPU (`stream` None)."""
    if stream is None:
        return
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            t.record_stream(stream)
        elif isinstance(t, torch.Tensor) and t.device.type == faked_device.NAME:
            faked_device.record_stream(t, stream)


def handed_over(value: object, finished: object | None) -> object:
    """`value`, made by a job whose stream recorded `finished`, made safe to use on this
    thread's current stream: the stream waits for the event (the host does not), and each
    tensor in `value` is recorded as used by it. A no-op on CPU."""
    if finished is None:
        return value
    here = current_stream()
    here.wait_event(finished)
    used_on(value, here)
    return value


def copies_landed() -> None:
    """Wait until the copies this thread's current stream has queued have landed: a host
    buffer a non-blocking copy from the device writes may be read after this (a no-op on
    a CPU, where a copy is done when it returns)."""
    if on_accelerator():
        current_stream().synchronize()


@contextmanager
def on_copy_stream(ready: object | None = None) -> Iterator[None]:
    """Run the block's copies on this rank's copy stream, after the compute stream's work
    up to `ready` (from `compute_ready`), then wait for them (the calling thread waits, not
    the compute stream). On CPU the block just runs, and the thread that runs it (a copy
    thread) stands for the stream."""
    global _copy_stream
    if not on_accelerator():
        yield
        return
    if _copy_stream is None or _copy_stream.device != device():
        _copy_stream = side_stream()
    with on_stream(_copy_stream, ready):
        yield
    _copy_stream.synchronize()


def device_seconds(fn, repeats: int = 3) -> float:
    """The best of `repeats` runs of `fn()`, in seconds of this rank's device: between two
    events on the current stream on a GPU (what the host clock sees there is when work was
    queued, not when it ran), by the host's clock on a CPU."""
    import time

    best = float("inf")
    for _ in range(repeats):
        if on_accelerator():
            accelerator = _accelerator()
            start, end = accelerator.Event(enable_timing=True), accelerator.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - began)
    return best


class DeviceClock:
    """The Timeline's clock on a device (trace.set_device_clock): a mark is an event
    recorded on the calling thread's current stream, read when the capture ends as a time
    on the host's perf_counter axis. The axis is tied once per device: an event recorded
    while the device is idle, at a known host time. Off the device, no marks."""

    def __init__(self) -> None:
        self._ref: dict[str, tuple[object, float]] = {}

    def mark(self) -> tuple[str, object] | None:
        if not on_accelerator():
            return None
        key = str(device())
        if key not in self._ref:
            self._ref[key] = self._tie()
        event = _accelerator().Event(enable_timing=True)
        event.record(current_stream())  # the rank's device, whatever this thread set
        return key, event

    @staticmethod
    def _tie() -> tuple[object, float]:
        import time

        idle = device().type == "cuda"  # the faked device's work is done when queued
        if idle:
            torch.cuda.synchronize(device())
        event = _accelerator().Event(enable_timing=True)
        event.record(current_stream())
        if idle:
            event.synchronize()
        # the device was idle, so the event ran as it was queued; the host time read after
        # the synchronize is late by that call's return, a few microseconds
        return event, time.perf_counter()

    def seconds(self, marks: list[tuple[str, object]]) -> list[float]:
        for key in {key for key, _ in marks if key.startswith("cuda")}:
            torch.cuda.synchronize(torch.device(key))  # every mark done: its time is known
        out = []
        for key, event in marks:
            ref, host = self._ref[key]
            out.append(host + ref.elapsed_time(event) / 1e3)
        return out


# a rank on a device records the device's times; on a CPU, mark() is None and nothing changes
trace.set_device_clock(DeviceClock())
