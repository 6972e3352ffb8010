"""Event, Timeline, recording and Chrome-trace round trips."""

import json

import pytest

from minipar import trace
from minipar.trace import Event, Timeline


def two_rank_timeline() -> Timeline:
    return Timeline([
        Event(0, "compute", "F0", 0.0, 1.0, microbatch=0, stage=0),
        Event(0, "compute", "inner", 0.2, 0.5),           # nested: counts once
        Event(0, "send", "act", 1.0, 1.25, peer=1, bytes=4096, args={"chunk": 2}),
        Event(1, "recv", "act", 1.0, 1.25, peer=0, bytes=4096),
        Event(1, "compute", "F0", 1.25, 2.0, microbatch=0, stage=1),
        Event(1, "wait", "barrier", 2.0, 2.5),
    ])


def test_summary_counts_busy_comm_and_idle():
    s = two_rank_timeline().summary()
    assert s.makespan == 2.5
    assert s.busy == [1.0, 0.75]
    assert s.comm == [0.25, 0.75]
    assert s.idle == [1.25, 1.0]
    assert [b + c + i for b, c, i in zip(s.busy, s.comm, s.idle, strict=True)] == [2.5, 2.5]
    assert s.bubble_fraction == pytest.approx(1 - 1.75 / 5.0)
    assert "rank 1" in str(s)


def test_tracks_follow_kinds():
    assert [trace.track_of(k) for k in ("F", "send", "recv", "all_reduce", "wait")] == [
        "compute", "send", "recv", "comm", "comm"]


def test_chrome_round_trip(tmp_path):
    original = two_rank_timeline()
    path = original.save_chrome(tmp_path / "run.json")
    data = json.loads(path.read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in complete} == {0, 1, 2, 3}
    assert complete[0]["ts"] == 0.0 and complete[0]["dur"] == 1e6
    back = Timeline.from_chrome(path)
    assert [(e.rank, e.kind, e.label, e.microbatch, e.peer, e.bytes, e.args) for e in back] == [
        (e.rank, e.kind, e.label, e.microbatch, e.peer, e.bytes, e.args) for e in original]
    assert [e.start for e in back] == pytest.approx([e.start for e in original])


def test_record_and_capture_nest():
    with trace.capture(rank=5) as outer:
        with trace.record("compute", "a", microbatch=1, color="red"):
            pass
        with trace.capture(rank=6) as inner:
            with trace.record("send", "b", peer=0):
                pass
        trace.add_event("compute", "manual", 0.0, 0.001)
    assert [(e.rank, e.label) for e in inner.events] == [(6, "b")]
    assert [(e.rank, e.label) for e in outer.events] == [(5, "a"), (5, "manual")]
    first = outer.events[0]
    assert first.microbatch == 1 and first.args == {"color": "red"} and first.end >= first.start


def test_recording_can_be_switched_off():
    with trace.capture() as captured:
        previous = trace.set_recording(False)
        with trace.record("compute", "hidden"):
            pass
        trace.set_recording(previous)
    assert captured.events == []


def test_empty_timeline_is_harmless():
    empty = Timeline()
    assert empty.makespan == 0 and empty.summary().bubble_fraction == 0.0


def test_waiting_inside_a_compute_span_is_not_busy():
    timeline = Timeline([Event(0, "compute", "backward", 0.0, 1.0),
                         Event(0, "wait", "gradient sync", 0.6, 1.0),
                         Event(0, "compute", "optimizer", 1.0, 1.2)])
    s = timeline.summary()
    assert s.busy == pytest.approx([0.8]) and s.comm == pytest.approx([0.4])
    assert s.idle == pytest.approx([0.0])
    assert trace.overlap_length([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)


def test_a_communication_threads_wait_does_not_stop_the_main_thread_computing():
    # main thread: backward 0-1.0; comm thread: all-reduce 0.2-0.9, blocked 0.3-0.6
    overlapped = Timeline([Event(0, "compute", "backward", 0.0, 1.0),
                           Event(0, "all_reduce", "bucket 0", 0.2, 0.9, thread=1),
                           Event(0, "wait", "for the peer", 0.3, 0.6, thread=1),
                           Event(0, "all_reduce", "bucket 1", 1.0, 1.5, thread=1)])
    s = overlapped.summary()
    assert s.busy == [pytest.approx(1.0)]  # overlapped communication costs nothing
    assert s.comm == [pytest.approx(0.5)] and s.idle == [pytest.approx(0.0)]
    assert s.bubble_fraction == pytest.approx(1 / 3)
    # the same wait on the main thread means the main thread stopped computing
    blocked = Timeline([*overlapped.events[:2], Event(0, "wait", "sync", 0.3, 0.6),
                        overlapped.events[3]])
    assert blocked.summary().busy == [pytest.approx(0.7)]


def test_recorded_events_say_which_thread_recorded_them():
    import threading

    with trace.capture(rank=0) as captured:
        with trace.record("compute", "main"), trace.record("compute", "main again"):
            pass
        side = trace.record("all_reduce", "side")
        side.__enter__()
        thread = threading.Thread(target=side.__exit__)
        thread.start()
        thread.join()
    threads = {e.label: e.thread for e in captured.events}
    assert threads == {"main again": 0, "main": 0, "side": 1}
    restored = Timeline.from_chrome(captured.timeline.to_chrome())
    assert {e.label: e.thread for e in restored} == threads


def test_aligned_puts_ranks_on_one_clock_at_a_collectives_end():
    # rank 1's clock started 4 ms late: its all-reduces seem to end 4 ms before rank 0's
    skewed = Timeline([
        Event(0, "compute", "step 0", 0.000, 0.010), Event(0, "wait", "all_reduce", 0.010, 0.030),
        Event(0, "compute", "step 1", 0.030, 0.040), Event(0, "wait", "all_reduce", 0.040, 0.060),
        Event(0, "compute", "step 2", 0.060, 0.070), Event(0, "wait", "all_reduce", 0.070, 0.090),
        Event(1, "compute", "step 0", 0.000, 0.026), Event(1, "wait", "all_reduce", 0.026, 0.026),
        Event(1, "compute", "step 1", 0.026, 0.052), Event(1, "wait", "all_reduce", 0.052, 0.0565),
        Event(1, "compute", "step 2", 0.0565, 0.086), Event(1, "wait", "all_reduce", 0.086, 0.086),
    ])
    offsets = skewed.clock_offsets("wait", "all_reduce")
    assert offsets[0] == 0.0
    assert offsets[1] == pytest.approx(0.004)  # median of 4, 3.5 and 4 ms: one noisy end ignored
    one_clock = skewed.aligned("wait", "all_reduce")
    ends = [[e.end for e in one_clock.for_rank(r) if e.kind == "wait"] for r in (0, 1)]
    assert ends[0][0] == pytest.approx(ends[1][0]) and ends[1][1] == pytest.approx(0.0605)
    # durations are each rank's own measurements: aligning moves events, never stretches them
    assert [e.duration for e in one_clock.for_rank(1)] == pytest.approx(
        [e.duration for e in skewed.for_rank(1)])
    assert skewed.for_rank(1)[0].start == 0.0  # the original is left as it was
    with pytest.raises(ValueError, match="rank 1 has no event of kind 'barrier'"):
        Timeline([Event(0, "barrier", "", 0, 1), Event(1, "compute", "", 0, 1)]).aligned(
            "barrier")


class _TenSecondsAMark:
    """A device clock whose consecutive marks are 10 s apart on the device."""

    def __init__(self):
        self.n = 0

    def mark(self):
        self.n += 1
        return self.n

    def seconds(self, marks):
        return [10.0 * m for m in marks]


def test_with_a_device_clock_the_timeline_reads_the_devices_times_but_a_wait_the_hosts():
    previous = trace.set_device_clock(_TenSecondsAMark())
    try:
        with trace.capture(rank=0) as captured:
            with trace.record("compute", "kernel"):
                pass
            with trace.record("wait", "host blocked"):
                pass
            start = trace.now()
            trace.add_event("send", "message", start, trace.now())
    finally:
        trace.set_device_clock(previous)
    spans = {e.label: e.duration for e in captured.events}
    assert spans["kernel"] == 10.0 and spans["message"] == 10.0
    assert spans["host blocked"] < 1.0


def test_on_the_faked_device_the_timeline_reads_its_events():
    from minipar.runtime import faked_device
    from minipar.runtime.device import faked_for_task

    elapsed = faked_device.FakedEvent.elapsed_time
    # the device runs every event 5 s after the host queued it
    faked_device.FakedEvent.elapsed_time = lambda self, end: elapsed(self, end) + 5000.0
    try:
        with faked_for_task(True, 0), trace.capture(rank=0) as captured:
            with trace.record("compute", "kernel"):
                pass
            with trace.record("wait", "host blocked"):
                pass
    finally:
        faked_device.FakedEvent.elapsed_time = elapsed
    at = {e.label: e.start for e in captured.events}
    assert at["kernel"] > 4.0 > at["host blocked"]
