"""Events and timelines: the one picture shared by simulators, real runs and trace files.

Everything a rank does is an `Event` (who, what, when, and where it applies). A
`Timeline` is the events of all ranks on one clock. Simulators build Timelines from
a plan, ranks record them as they run (`record`), and Chrome trace files carry them
in and out, so any run opens in Perfetto or chrome://tracing.

Times are seconds from the run's t=0; inside `minipar.launch` every rank sets its
t=0 right after a common barrier, so clocks agree to within that barrier's skew;
`Timeline.aligned` removes the skew by lining up the ends of a collective every rank ran.

On a GPU the host's clock says when a thread queued work, not when the GPU ran it. There
a device clock is set (`set_device_clock`; runtime/streams.py's `DeviceClock`): each
recorded block and each time from `now()` also leaves a mark in the device's work (an
event on the calling thread's stream), and a capture reads the marks' device times when
it ends, on the same axis as the host's. A "wait" is the host blocked, and stays on the
host's clock; on a GPU few waits block (a NCCL request's `wait()` and a stream's wait
for an event return at once), so there a stall shows as a gap in the device's work,
not as a wait.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from time import perf_counter
from typing import Any

# re-exported: the Timeline's summary and interval arithmetic live in time_spans.py
from .time_spans import (  # noqa: F401
    Summary,
    merged_intervals,
    overlap_length,
    subtract,
    union_length,
)

# Which row of a trace an event kind is drawn on. Kinds not listed are computation.
COMM_KINDS = frozenset(
    {"comm", "collective", "barrier", "wait", "all_reduce", "broadcast", "reduce",
     "all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"}
)
TRACKS = ("compute", "send", "recv", "comm")
# One device's streams, drawn one per row (the Timeline's "rank" is the stream's index):
# its compute, the network, and a second channel (host<->device copies, links in a node).
# SE-MoE's schedules and the offloaded runs share these rows.
STREAMS = ("compute", "network", "copy")


def track_of(kind: str) -> str:
    """The trace row an event of this kind belongs on: compute, send, recv or comm."""
    if kind in ("send", "recv"):
        return kind
    return "comm" if kind in COMM_KINDS else "compute"


@dataclass(slots=True)
class Event:
    """One thing one rank did, from `start` to `end` (seconds on the run's clock)."""

    rank: int
    kind: str
    label: str
    start: float
    end: float
    microbatch: int | None = None
    stage: int | None = None
    peer: int | None = None
    bytes: int | None = None
    step: int | None = None
    thread: int = 0  # 0: the rank's main thread; 1, 2, ...: its other threads, in order seen
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def track(self) -> str:
        return track_of(self.kind)


_EVENT_FIELDS = {f.name for f in fields(Event)}
_OPTIONAL_FIELDS = ("microbatch", "stage", "peer", "bytes", "step")


class Timeline:
    """The events of all ranks on one clock, sorted by start time."""

    def __init__(self, events: Iterable[Event] = ()) -> None:
        # rank and end break ties in start, so equal timelines list their events in one order
        self.events: list[Event] = sorted(events, key=lambda e: (e.start, e.rank, e.end))

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __repr__(self) -> str:
        return (f"Timeline({len(self.events)} events, ranks={self.ranks}, "
                f"makespan={self.makespan:.4f}s)")

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first event's start to the last event's end."""
        return self.end - self.start

    def for_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def filter(self, kind: str | None = None, track: str | None = None) -> Timeline:
        """The events of one kind and/or on one track."""
        return Timeline(e for e in self.events
                        if (kind is None or e.kind == kind) and (track is None or e.track == track))

    def summary(self, world_size: int | None = None) -> Summary:
        """Compute, communication and idle time per rank; they add up to the makespan.

        Busy is the time when some thread of the rank computes (a compute-track event)
        and is not blocked in a "wait" of its own: a wait inside a compute span means that
        thread stopped computing, while another thread's work, say a communication thread
        all-reducing, overlaps the computation and costs nothing. Comm is the rest of the
        time covered by events (communication not hidden under computation); idle is the
        time no thread of the rank does anything. The bubble fraction is the share of all
        rank-time not spent computing: 1 - sum(busy) / (ranks x makespan).
        """
        n = world_size if world_size is not None else (max(self.ranks) + 1 if self.events else 0)
        span = self.makespan
        busy, comm, idle = [], [], []
        for r in range(n):
            mine = [e for e in self.events if e.rank == r]
            computing = []
            # per thread: a "wait" pauses only the thread that waits, not the rank's other threads
            for thread in {e.thread for e in mine}:
                on = [e for e in mine if e.thread == thread]
                computing += subtract([(e.start, e.end) for e in on if e.track == "compute"],
                                      [(e.start, e.end) for e in on if e.kind == "wait"])
            compute = union_length(computing)
            covered = union_length([(e.start, e.end) for e in mine])
            busy.append(compute)
            comm.append(covered - compute)
            # clamped: float error in the unions must not show a tiny negative idle time
            idle.append(max(span - covered, 0.0))
        bubble = 1.0 - sum(busy) / (n * span) if n and span > 0 else 0.0
        return Summary(span, busy, comm, idle, bubble)

    @property
    def bubble_fraction(self) -> float:
        return self.summary().bubble_fraction

    def clock_offsets(self, kind: str, label: str | None = None) -> dict[int, float]:
        """Seconds to add to each rank's times so that its collectives end with the lowest
        rank's: the median, over its n-th event of `kind` (and `label`) matched with the
        lowest rank's n-th, of the difference of their ends.

        Ranks set t=0 as they leave a barrier, and they leave it at different instants
        (a rank woken late by the scheduler, a message still in flight), so their clocks
        disagree by that skew. A collective such as an all-reduce ends at about the same
        instant on every rank: none can finish before the last contribution arrives, and
        then all finish within one message's latency. Its ends are a mark every rank saw,
        and the median over many of them ignores one that a late wake-up moved.
        """
        ends = {r: [e.end for e in self.events if e.rank == r and e.kind == kind
                    and (label is None or e.label == label)] for r in self.ranks}
        if not ends:
            return {}
        reference = ends[min(ends)]
        offsets = {}
        for r, mine in ends.items():
            # strict=False: a rank that ran fewer of them is matched on those it ran
            pairs = [a - b for a, b in zip(reference, mine, strict=False)]
            if not pairs:
                raise ValueError(f"rank {r} has no event of kind {kind!r}"
                                 + (f" labelled {label!r}" if label is not None else "")
                                 + " to align its clock on")
            offsets[r] = statistics.median(pairs)
        return offsets

    def aligned(self, kind: str, label: str | None = None) -> Timeline:
        """The same events on one clock: each rank shifted by `clock_offsets(kind, label)`,
        so that its collectives of that kind end when the lowest rank's do."""
        offsets = self.clock_offsets(kind, label)
        return Timeline(replace(e, start=e.start + offsets[e.rank], end=e.end + offsets[e.rank],
                                args=dict(e.args)) for e in self.events)

    # --- Chrome trace (Perfetto) ---

    def to_chrome(self) -> dict:
        """Chrome trace JSON: one complete ("X") event each; pid = rank, tid = track."""
        trace: list[dict] = []
        for r in self.ranks:
            # Chrome's trace format: "M" metadata events name a process (a rank) and its threads
            # (our tracks), so Perfetto labels the rows
            trace.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                          "args": {"name": f"rank {r}"}})
            for tid, name in enumerate(TRACKS):
                trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                              "args": {"name": name}})
        for e in self.events:
            args = {k: getattr(e, k) for k in _OPTIONAL_FIELDS if getattr(e, k) is not None}
            if e.thread:
                args["thread"] = e.thread
            args.update(e.args)
            trace.append({"name": e.label or e.kind, "cat": e.kind, "ph": "X",
                          # the Chrome trace format counts ts and dur in microseconds
                          "ts": e.start * 1e6, "dur": e.duration * 1e6,
                          "pid": e.rank, "tid": TRACKS.index(e.track), "args": args})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save_chrome(self, path: str | os.PathLike) -> Path:
        """Write the Chrome trace JSON to `path` (open it in Perfetto)."""
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    @classmethod
    def from_chrome(cls, source: str | os.PathLike | dict) -> Timeline:
        """Read a Chrome trace (a path or the parsed JSON); keeps its complete events."""
        data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        raw = data["traceEvents"] if isinstance(data, dict) else data
        events = []
        for item in raw:
            if item.get("ph") != "X":
                continue
            args = dict(item.get("args", {}))
            # to_chrome put the Event fields among args: take them back out
            named = {k: args.pop(k) for k in (*_OPTIONAL_FIELDS, "thread") if k in args}
            start = item["ts"] / 1e6
            events.append(Event(rank=int(item["pid"]), kind=item.get("cat") or item["name"],
                                label=item["name"], start=start,
                                end=start + item.get("dur", 0) / 1e6, args=args, **named))
        return cls(events)


# --- recording inside a process ---

class _Recorder:
    """This process's event buffer: a perf_counter pair and a list append per event."""

    __slots__ = ("enabled", "t0", "rank", "buffer", "clock")

    def __init__(self) -> None:
        self.enabled = True
        self.t0 = perf_counter()
        self.rank = 0
        self.buffer: list[tuple] = []
        self.clock: Any = None  # a device clock (runtime/streams.py), or None: the host's


class Stamp(float):
    """A time from `now()` that also holds a mark in the device's work (`mark`), where a
    device clock is set: `add_event` then records the device's time for it."""

    mark: Any = None


_recorder = _Recorder()


class record:
    """Record the block as one event: ``with record("compute", "forward", microbatch=0): ...``.

    Keyword fields are Event fields (microbatch, stage, peer, bytes, step); any other
    keyword goes into `Event.args`. Costs about a microsecond; `set_recording(False)`
    turns it into a no-op.
    """

    __slots__ = ("kind", "label", "fields", "start", "mark")

    def __init__(self, kind: str, label: str = "", **fields: Any) -> None:
        self.kind, self.label, self.fields = kind, label, fields

    def __enter__(self) -> record:
        clock = _recorder.clock
        # a wait is the host blocked: the host's clock is its clock
        self.mark = None if clock is None or self.kind == "wait" or not _recorder.enabled \
            else clock.mark()
        self.start = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if _recorder.enabled:
            # a plain tuple while recording: Events are built at capture's exit, off the hot path
            end = perf_counter()
            last = None if self.mark is None else _recorder.clock.mark()
            # both ends on the device's clock, or both on the host's
            marks = None if last is None else (self.mark, last)
            _recorder.buffer.append((self.kind, self.label, self.start, end, self.fields,
                                     threading.get_ident(), marks))


def add_event(kind: str, label: str, start: float, end: float, **fields: Any) -> None:
    """Record an event whose times (from `now()`) were taken elsewhere."""
    if _recorder.enabled:
        t0 = _recorder.t0
        first, last = getattr(start, "mark", None), getattr(end, "mark", None)
        marks = None if first is None or last is None else (first, last)
        # the buffer holds raw perf_counter times: add t0 back, capture subtracts it again
        _recorder.buffer.append((kind, label, start + t0, end + t0, fields,
                                 threading.get_ident(), marks))


def now() -> float:
    """Seconds since this run's t=0 (the clock events are recorded on); with a device
    clock set, a `Stamp` that also marks this point of the device's work."""
    t = perf_counter() - _recorder.t0
    clock = _recorder.clock
    mark = None if clock is None or not _recorder.enabled else clock.mark()
    if mark is None:
        return t
    stamp = Stamp(t)
    stamp.mark = mark
    return stamp


def set_device_clock(clock: Any) -> Any:
    """Record device times with `clock` (an object with `mark()`, returning a mark of the
    work queued so far on the calling thread's stream or None, and `seconds(marks)`, their
    times on perf_counter's axis), or with the host's alone (None). Returns the previous."""
    previous, _recorder.clock = _recorder.clock, clock
    return previous


def set_recording(enabled: bool) -> bool:
    """Switch event recording on or off in this process; returns the previous setting."""
    previous, _recorder.enabled = _recorder.enabled, bool(enabled)
    return previous


def _to_event(rank: int, t0: float, item: tuple, threads: dict[int, int]) -> Event:
    kind, label, start, end, extra, ident = item
    named = {k: v for k, v in extra.items() if k in _EVENT_FIELDS}
    others = {k: v for k, v in extra.items() if k not in _EVENT_FIELDS}
    # thread idents are large and reused by the OS: number threads 0, 1, 2 in order first seen
    thread = threads.setdefault(ident, len(threads))
    return Event(rank, kind, label, start - t0, end - t0, thread=thread, args=others, **named)


class capture:
    """Collect what this process records inside the block: ``with capture() as c: ...; c.timeline``.

    Entering sets t=0 (now) and the rank stamped on events. Captures nest: an outer
    capture does not see the inner one's events.
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self.events: list[Event] = []

    def __enter__(self) -> capture:
        # saved and restored on exit: a capture inside another leaves the outer one's buffer whole
        self._saved = (_recorder.t0, _recorder.rank, _recorder.buffer)
        if self.rank is None:  # the rank that minipar's workers and torchrun both export
            self.rank = int(os.environ.get("RANK", 0))
        _recorder.rank, _recorder.buffer, _recorder.t0 = self.rank, [], perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        t0, rank = _recorder.t0, _recorder.rank
        threads = {threading.get_ident(): 0}  # the capturing thread (it enters and exits)
        self.events = [_to_event(rank, t0, item[:6], threads)
                       for item in _on_the_device_clock(_recorder.buffer)]
        _recorder.t0, _recorder.rank, _recorder.buffer = self._saved

    @property
    def timeline(self) -> Timeline:
        return Timeline(self.events)


def _on_the_device_clock(buffer: list[tuple]) -> list[tuple]:
    """The buffer with each marked item's times read from its device marks."""
    marked = [item for item in buffer if item[6] is not None]
    if not marked or _recorder.clock is None:
        return buffer
    seconds = iter(_recorder.clock.seconds([mark for item in marked for mark in item[6]]))
    times = {id(item): (next(seconds), next(seconds)) for item in marked}
    return [item if item[6] is None else (*item[:2], *times[id(item)], *item[4:])
            for item in buffer]
