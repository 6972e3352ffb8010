"""The faked device's accelerator module (faked_device.py registers it with torch as
`torch.fakegpu`): the calls torch and minipar make of `torch.cuda`, answered for a
device whose work is done when it is queued. Streams and events are objects that keep
which waited for which, and `record_stream` calls are kept, so tests can check the
rules runtime/streams.py follows; each thread keeps its current device, as CUDA does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

NAME = "fakegpu"
_in_flight: set[int] = set()  # host storages a non-blocking copy from the device still writes
_lock = threading.Lock()
_current = threading.local()  # this thread's current device index, as CUDA keeps one
opened: set[int] = set()  # the devices a thread of this process has worked on (a context)


def current_device() -> int:
    index = getattr(_current, "index", None)
    if index is None:
        # as CUDA does: a thread that never chose a device works on device 0, and the
        # first touch opens a context there
        opened.add(0)
        return 0
    return index


def set_device(index) -> None:
    _current.index = torch.device(NAME, index).index if isinstance(index, str) else int(
        index.index if isinstance(index, torch.device) else index)
    opened.add(_current.index)


def device_count() -> int:
    return int(os.environ.get("MINIPAR_FAKED_DEVICES", "8"))


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    """Its random numbers are the host's: torch.manual_seed seeds them already."""


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What autocast may cast to here (torch.utils.checkpoint asks, to replay a region)."""
    return [torch.float16, torch.bfloat16]


def get_rng_state(device=None) -> torch.Tensor:
    """Its random numbers are the host's (recomputation saves and restores them)."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(state)


def synchronize(device=None) -> None:
    """Work on the faked device is done when its op returns; copies to the host may be
    read from here on."""
    _landed()


def _landed() -> None:
    with _lock:
        _in_flight.clear()


def get_device_name(device=None) -> str:
    return "minipar faked device"


class FakedEvent:
    """A mark in a stream: on the faked device, done when recorded. It keeps the stream
    it was recorded on, so a test can ask which stream waited for which."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.time = 0.0
        self.stream: FakedStream | None = None

    def record(self, stream: FakedStream | None = None) -> None:
        import time
        self.time = time.perf_counter()
        self.stream = stream if stream is not None else current_stream()

    def synchronize(self) -> None:
        _landed()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakedEvent) -> float:
        return (end.time - self.time) * 1e3


class FakedStream:
    """A queue of work on one device: on the faked device, run as it is queued. It keeps
    the events it was told to wait for (`waited`), and each device has one default
    stream, current on every thread until a `stream(...)` block picks another."""

    def __init__(self, device=None, priority: int = 0, default: bool = False) -> None:
        self.device = torch.device(NAME, current_device() if device is None else
                                   torch.device(device).index)
        self.default = default
        self.waited: list[FakedEvent] = []

    def wait_event(self, event: FakedEvent) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: FakedStream) -> None:
        self.waited.append(stream.record_event())

    def synchronize(self) -> None:
        _landed()

    def record_event(self, event: FakedEvent | None = None) -> FakedEvent:
        event = event or FakedEvent()
        event.record(self)
        return event


_defaults: dict[int, FakedStream] = {}
used_on: list[tuple[int, FakedStream]] = []  # (storage, stream) of each record_stream


@contextmanager
def stream(s: FakedStream | None) -> Iterator[None]:
    """Make `s` current in the block. As CUDA does, entering a stream of device i makes i
    the thread's current device: a thread that never set its device touches device 0."""
    previous, previous_stream = current_device(), getattr(_current, "stream", None)
    if s is not None:
        set_device(s.device.index)
        _current.stream = s
    try:
        yield
    finally:
        set_device(previous)
        _current.stream = previous_stream


def current_stream(device=None) -> FakedStream:
    """This thread's current stream on `device`: the one its `stream` block picked, else
    the device's default stream."""
    index = current_device() if device is None else _index(device)
    chosen = getattr(_current, "stream", None)
    if chosen is not None and chosen.device.index == index:
        return chosen
    with _lock:
        return _defaults.setdefault(index, FakedStream(torch.device(NAME, index), default=True))


def record_stream(tensor: torch.Tensor, s: FakedStream) -> None:
    """`tensor.record_stream(s)`: kept, so a test can see which tensors were handed over."""
    with _lock:
        used_on.append((tensor.untyped_storage().data_ptr(), s))


Event, Stream = FakedEvent, FakedStream  # the names torch's device modules use


def memory_allocated(device=None) -> int:
    return 0


def max_memory_allocated(device=None) -> int:
    return 0


def reset_peak_memory_stats(device=None) -> None:
    pass


def _index(device) -> int:
    index = None if device is None else torch.device(device).index
    return current_device() if index is None else index
