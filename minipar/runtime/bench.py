"""`minipar bench launch`: what starting ranks and recording events cost (cold launch with
forkserver and spawn, a warm Cluster.run, one recorded event)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from .. import trace
from ..report import format_table, human_seconds, progress, save_results, timed
from .cluster import Cluster, launch


def nothing() -> None:
    """The empty task: what a launch costs with no work in it."""
    return None


def record_overhead(events: int = 200_000) -> tuple[float, float]:
    """Seconds per recorded event, with recording on and switched off."""
    def loop() -> None:
        for _ in range(events):
            with trace.record("compute", "x"):
                pass

    def empty() -> None:
        for _ in range(events):
            pass

    # minimum of 3: the least disturbed run; the empty loop's own cost is subtracted
    base = min(timed(empty) for _ in range(3))
    with trace.capture():
        on = min(timed(loop) for _ in range(3))
        previous = trace.set_recording(False)
        off = min(timed(loop) for _ in range(3))
        trace.set_recording(previous)
    return (on - base) / events, (off - base) / events


def measure(world_size: int = 4, cold_repeats: int = 3, warm_repeats: int = 50) -> list[dict]:
    """Cold launch (forkserver vs spawn), warm Cluster.run and per-event recording cost."""
    rows = []
    for method, fresh in (("forkserver", True), ("forkserver", False), ("spawn", False)):
        times = []
        for i in range(cold_repeats):
            progress(f"launch with {method}{', fresh Python' if fresh else ''}, "
                      f"{i + 1}/{cold_repeats}")
            times.append(_fresh_launch(world_size) if fresh
                         else timed(lambda m=method: _cold(world_size, m)))
        what = ("first launch in a fresh Python" if fresh else
                "next launch, server running" if method == "forkserver" else "launch")
        rows.append({"measure": f"{what}, {world_size} ranks ({method})",
                     "median": statistics.median(times), "range": [min(times), max(times)],
                     "unit": "s",
                     "goal": 4.0 if method == "forkserver" else None})
    progress(f"warm Cluster.run x{warm_repeats}")
    with Cluster(world_size, backend="gloo") as cluster:
        # warm-up runs first: the first few pay for imports and gloo's first connections
        for _ in range(5):
            cluster.run(nothing)
        warm = [timed(lambda: cluster.run(nothing)) for _ in range(warm_repeats)]
    rows.append({"measure": f"warm Cluster.run, {world_size} ranks", "median":
                 statistics.median(warm), "range": [min(warm), max(warm)], "unit": "s",
                 "goal": 0.020})
    overheads = [record_overhead() for _ in range(3)]
    for i, state in enumerate(("on", "off")):
        each = [o[i] for o in overheads]
        rows.append({"measure": f"record() per event, recording {state}",
                     "median": statistics.median(each), "range": [min(each), max(each)],
                     "unit": "s", "goal": 2e-6 if state == "on" else None})
    for row in rows:
        row["meets_goal"] = None if row["goal"] is None else row["median"] <= row["goal"]
    return rows


def _fresh_launch(world_size: int) -> float:
    """Seconds for launch() in a new interpreter (minipar imported, no server yet)."""
    code = ("import time, minipar\n"
            "from minipar.runtime.bench import nothing\n"
            "t = time.perf_counter()\n"
            f"minipar.launch(nothing, {world_size}, backend='gloo')\n"
            "print(time.perf_counter() - t)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _cold(world_size: int, method: str) -> None:
    if method == "forkserver":
        launch(nothing, world_size, backend="gloo")
    else:
        with Cluster(world_size, backend="gloo", start_method=method) as cluster:
            cluster.run(nothing)


def report(rows: list[dict], out_dir: Path) -> str:
    """Print-ready table; writes bench_launch.json and bench_launch.png into out_dir."""
    from matplotlib.figure import Figure

    shown = [{"measure": r["measure"], "median": f"{human_seconds(r['median'])} ("
              f"{human_seconds(r['range'][0])}-{human_seconds(r['range'][1])})",
              "goal": "" if r["goal"] is None else "<= " + human_seconds(r["goal"]),
              "ok": {None: "", True: "yes", False: "NO"}[r["meets_goal"]]} for r in rows]
    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.add_subplot()
    goals = [r for r in rows if r["goal"]]
    ax.barh([r["measure"] for r in goals], [r["median"] / r["goal"] for r in goals],
            color=["#55A868" if r["meets_goal"] else "#C44E52" for r in goals])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("measured / goal (left of the line meets the goal)")
    save_results(rows, fig, out_dir, "launch",
                 title="launch and recording costs against their goals")
    return format_table(shown, [("measure", "measure"), ("median", "median (min-max)"),
                                ("goal", "goal"), ("ok", "meets goal")])
