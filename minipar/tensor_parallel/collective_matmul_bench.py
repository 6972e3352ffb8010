"""`minipar bench tp-overlap`: how much of sequence parallelism's communication the
collective matmul hides, on an emulated slow link and on loopback, by hidden size.

A Megatron MLP (column-parallel up, GELU, row-parallel down; ffn = 4 x hidden) under
sequence parallelism on tp = 2, forward and backward, in two versions that move the same
bytes: the collectives then the matmuls (`ColumnParallelLinear`, `RowParallelLinear`),
and the two overlapped (`collective_matmul.py`). Every step is traced, and
`exposed_and_hidden` splits its communication into the seconds the main thread's
compute hid and the seconds it exposed. The versions take turns for `rounds` rounds; a
row keeps the medians and the overlapped step's speedup per round, whose spread is the
noise. A rank that computes ahead of its peer waits for the peer's data, and that wait is
skew, not the link: on a busy machine one rank may share its core and run at half speed,
and its peer then "waits" for every shift. The rank that arrives last waits only for the
link, so a step's exposure is the smaller of the two ranks'. The link is emulated by
sleeping the sender (`slow_network`), which costs no CPU, but gloo still copies each
message through loopback with a CPU thread: on 2 cores, a transfer running beside a rank's
matmul takes cycles from it, so a step may gain less than the exposed time it hid (on a
GPU the shifts have their own stream and copy engines).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..collectives import validation
from ..collectives.network import slow_network
from ..cost import Link
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster, rank
from ..trace import Event, Timeline, overlap_length, subtract, union_length
from .collective_matmul import OverlappedColumnParallelLinear, OverlappedRowParallelLinear
from .layers import ColumnParallelLinear, RowParallelLinear

HIDDEN = (64, 256, 1024, 2048)
# a slow link between two machines: 0.5 ms and 100 MB/s (a busy 1 Gbit/s Ethernet)
SLOW = Link(latency=5e-4, bandwidth=100e6)
LINKS = {"loopback": None, "0.5 ms, 100 MB/s": SLOW}
STEP_LABEL = "mlp step"


def exposed_and_hidden(events: list[Event]) -> tuple[float, float]:
    """One rank's communication in a step, split into seconds exposed and seconds hidden.

    Compute is the main thread's (thread 0) compute events less the time that thread itself
    communicates or waits; communication is every non-compute event of any thread. What a
    communication thread does while the main thread computes is hidden; the rest, a
    collective on the main thread or a wait for a late shift, is exposed."""
    talking = [(e.start, e.end) for e in events if e.track != "compute"]
    compute = main_compute(events)
    hidden = overlap_length(talking, compute)
    return union_length(talking) - hidden, hidden


def main_compute(events: list[Event]) -> list[tuple[float, float]]:
    """The main thread's compute intervals less the time it communicated or waited."""
    blocking = [(e.start, e.end) for e in events if e.track != "compute" and e.thread == 0]
    return subtract([(e.start, e.end) for e in events
                     if e.track == "compute" and e.thread == 0], blocking)


def _mlp(overlapped: bool, hidden: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)  # both versions cut the same weights
    up, down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
    column = OverlappedColumnParallelLinear if overlapped else ColumnParallelLinear
    row = OverlappedRowParallelLinear if overlapped else RowParallelLinear
    return (column.from_linear(up, sequence_parallel=True),
            row.from_linear(down, input_is_parallel=True, sequence_parallel=True))


def timed_steps(overlapped: bool, hidden: int, tokens: int, link: Link | None,
                steps: int) -> dict:
    """On every rank: median step seconds, each timed step's exposed and hidden
    communication, and the last step's events (its Timeline)."""
    torch.set_num_threads(1)  # one core per rank, as the trainer's benches run
    column, row = _mlp(overlapped, hidden)
    # this rank's slice of the sequence: [batch 2, tokens / 2 / tp, hidden]
    # it needs a gradient, as inside a model: the column layer's backward reduce-scatters it
    x = torch.randn(2, tokens // 4, hidden, requires_grad=True)
    seconds, exposed, hidden_s, events = [], [], [], []
    network = slow_network(link.latency, link.bandwidth) if link else slow_network()
    # no cross-rank argument handshake: the plain collectives would pay an extra round trip
    # per call that the overlapped shifts (point to point) do not
    with network, validation(False):
        for step in range(steps + 1):
            torch.distributed.barrier()
            with trace.capture(rank()) as captured:
                start = time.perf_counter()
                with trace.record("compute", STEP_LABEL, step=step):
                    row(torch.nn.functional.gelu(column(x))).sum().backward()
                took = time.perf_counter() - start
            if step:  # step 0 warms the allocator and the comm thread up
                e, h = exposed_and_hidden(captured.events)
                seconds.append(took)
                exposed.append(e)
                hidden_s.append(h)
                events = captured.events
    return {"seconds": statistics.median(seconds), "exposed": exposed, "hidden": hidden_s,
            "events": events}


def critical_rank(per_rank: list[dict]) -> dict:
    """Both ranks' runs as one: the step's seconds are its slower rank's, and each step's
    exposed and hidden communication are those of the rank that exposed less, the rank
    that arrived last (the other also waited for it), then the median over steps. The
    events, for the figure, are the last step's on the rank that arrived last."""
    pairs = [list(zip(p["exposed"], p["hidden"], strict=True)) for p in per_rank]
    steps = [min(step) for step in zip(*pairs, strict=True)]  # (exposed, hidden) per rank
    last = min(per_rank, key=lambda p: p["exposed"][-1])
    return {"seconds": max(p["seconds"] for p in per_rank),
            "exposed": statistics.median(exposed for exposed, _ in steps),
            "hidden": statistics.median(hidden for _, hidden in steps),
            "events": last["events"]}


def measure(hidden_sizes: tuple[int, ...] = HIDDEN, tokens: int = 1024, steps: int = 3,
            rounds: int = 3, links: tuple[str, ...] = tuple(LINKS)) -> list[dict]:
    """Unoverlapped vs overlapped MLP on tp = 2, per link (names in LINKS) and hidden size,
    in turns."""
    unknown = [name for name in links if name not in LINKS]
    if unknown:
        raise ValueError(f"links must be among {list(LINKS)}; got {unknown}")
    rows = []
    with Cluster(2, backend="gloo") as two:
        for link_name in links:
            link = LINKS[link_name]
            for hidden in hidden_sizes:
                progress(f"{link_name}, hidden {hidden}: {rounds} rounds in turns")
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for r in range(rounds):
                    # alternate who goes first: a machine that slows down mid-round hits both
                    for overlapped in (False, True) if r % 2 == 0 else (True, False):
                        per_rank = two.run(timed_steps, overlapped, hidden, tokens, link, steps)
                        runs[overlapped].append(critical_rank(per_rank))
                speedups = [p["seconds"] / o["seconds"]
                            for p, o in zip(runs[False], runs[True], strict=True)]
                row = {"link": link_name, "hidden": hidden, "tokens": tokens,
                       "speedups": speedups, "speedup": statistics.median(speedups)}
                for name, overlapped in (("plain", False), ("overlapped", True)):
                    for key in ("seconds", "exposed", "hidden"):
                        row[f"{name}_{key}"] = statistics.median(x[key] for x in runs[overlapped])
                    row[f"{name}_events"] = runs[overlapped][-1]["events"]
                rows.append(row)
    return rows


def step_timeline(row: dict) -> Timeline:
    """One measured step of each version on one clock, for `render_timeline`: row 0 the
    collectives then the matmuls, row 1 the overlapped layers. Compute is the main thread's
    time less what it spent communicating or waiting; every communication event is drawn
    in the strip below, so what overlaps a compute bar is hidden and the rest exposed."""
    events = []
    for lane, name in enumerate(("plain", "overlapped")):
        mine = row[f"{name}_events"]
        t0 = min(e.start for e in mine)
        events += [Event(lane, "compute", "", a - t0, b - t0) for a, b in main_compute(mine)]
        events += [Event(lane, e.kind, e.label, e.start - t0, e.end - t0) for e in mine
                   if e.track != "compute"]
    return Timeline(events)


def report(rows: list[dict], out_dir: Path) -> str:
    """Exposed communication and step time, unoverlapped vs overlapped; JSON and a plot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link]
        ax.plot([r["hidden"] for r in mine], [r["speedup"] for r in mine], marker="o",
                label=link)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hidden size (ffn = 4 x hidden), tp = 2")
    ax.set_ylabel("overlapped step speedup")
    ax.legend(fontsize=8)
    saved = [{k: v for k, v in r.items() if not k.endswith("_events")} for r in rows]
    save_results(saved, fig, out_dir, "tp_overlap",
                 title="collective matmul vs collectives then matmuls, tp = 2")
    shown = [{"link": r["link"], "hidden": r["hidden"],
              "plain": f"{r['plain_seconds'] * 1e3:.1f} ms",
              "plain_exposed": f"{r['plain_exposed'] * 1e3:.1f} ms",
              "overlapped": f"{r['overlapped_seconds'] * 1e3:.1f} ms",
              "overlapped_exposed": f"{r['overlapped_exposed'] * 1e3:.1f} ms",
              "speedup": ratio_cell(r["speedups"])} for r in rows]
    return ("an MLP's forward and backward under sequence parallelism, tp = 2, "
            f"{rows[0]['tokens']} tokens; the versions take turns; exposed = communication "
            "the main thread's compute did not hide (the rank that arrived last)\n"
            + format_table(shown, [("link", "link"), ("hidden", "hidden"),
                                   ("plain", "step"), ("plain_exposed", "exposed"),
                                   ("overlapped", "overlapped step"),
                                   ("overlapped_exposed", "exposed"),
                                   ("speedup", "speedup (min-max)")]))
