"""Measurements that print a table, write JSON and a plot: `minipar bench NAME`.

Each benchmark compares things measured in the same run and reports medians; times
on a shared 2-core machine move by 10-30% from run to run, so read ratios, not digits.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import trace
from .runtime import Cluster, launch


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _nothing() -> None:
    return None


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table of `rows` with (key, header) columns."""
    cells = [[header for _, header in columns]]
    cells += [[str(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def record_overhead(events: int = 200_000) -> tuple[float, float]:
    """Seconds per recorded event, with recording on and switched off."""
    def loop() -> None:
        for _ in range(events):
            with trace.record("compute", "x"):
                pass

    def empty() -> None:
        for _ in range(events):
            pass

    base = min(_timed(empty) for _ in range(3))
    with trace.capture():
        on = min(_timed(loop) for _ in range(3))
        previous = trace.set_recording(False)
        off = min(_timed(loop) for _ in range(3))
        trace.set_recording(previous)
    return (on - base) / events, (off - base) / events


def bench_launch(world_size: int = 4, cold_repeats: int = 3, warm_repeats: int = 50) -> list[dict]:
    """Cold launch (forkserver vs spawn), warm Cluster.run and per-event recording cost."""
    rows = []
    for method, fresh in (("forkserver", True), ("forkserver", False), ("spawn", False)):
        times = []
        for i in range(cold_repeats):
            _progress(f"launch with {method}{', fresh Python' if fresh else ''}, "
                      f"{i + 1}/{cold_repeats}")
            times.append(_fresh_launch(world_size) if fresh
                         else _timed(lambda m=method: _cold(world_size, m)))
        what = ("first launch in a fresh Python" if fresh else
                "next launch, server running" if method == "forkserver" else "launch")
        rows.append({"measure": f"{what}, {world_size} ranks ({method})",
                     "median": statistics.median(times), "unit": "s",
                     "goal": 4.0 if method == "forkserver" else None})
    _progress(f"warm Cluster.run x{warm_repeats}")
    with Cluster(world_size, backend="gloo") as cluster:
        for _ in range(5):
            cluster.run(_nothing)
        warm = [_timed(lambda: cluster.run(_nothing)) for _ in range(warm_repeats)]
    rows.append({"measure": f"warm Cluster.run, {world_size} ranks", "median":
                 statistics.median(warm), "unit": "s", "goal": 0.020})
    on, off = record_overhead()
    rows.append({"measure": "record() per event, recording on", "median": on, "unit": "s",
                 "goal": 2e-6})
    rows.append({"measure": "record() per event, recording off", "median": off, "unit": "s",
                 "goal": None})
    for row in rows:
        row["meets_goal"] = None if row["goal"] is None else row["median"] <= row["goal"]
    return rows


def _fresh_launch(world_size: int) -> float:
    """Seconds for launch() in a new interpreter (minipar imported, no server yet)."""
    code = ("import time, minipar\n"
            "from minipar.bench import _nothing\n"
            "t = time.perf_counter()\n"
            f"minipar.launch(_nothing, {world_size}, backend='gloo')\n"
            "print(time.perf_counter() - t)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _cold(world_size: int, method: str) -> None:
    if method == "forkserver":
        launch(_nothing, world_size, backend="gloo")
    else:
        with Cluster(world_size, backend="gloo", start_method=method) as cluster:
            cluster.run(_nothing)


def _human(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.2f} us"


def launch_report(rows: list[dict], out_dir: Path) -> str:
    """Print-ready table; writes bench_launch.json and bench_launch.png into out_dir."""
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_launch.json").write_text(json.dumps(rows, indent=2))
    shown = [{"measure": r["measure"], "median": _human(r["median"]),
              "goal": "" if r["goal"] is None else "<= " + _human(r["goal"]),
              "ok": {None: "", True: "yes", False: "NO"}[r["meets_goal"]]} for r in rows]
    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.add_subplot()
    goals = [r for r in rows if r["goal"]]
    ax.barh([r["measure"] for r in goals], [r["median"] / r["goal"] for r in goals],
            color=["#55A868" if r["meets_goal"] else "#C44E52" for r in goals])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("measured / goal (left of the line meets the goal)")
    fig.savefig(out_dir / "bench_launch.png", dpi=100)
    return format_table(shown, [("measure", "measure"), ("median", "median"),
                                ("goal", "goal"), ("ok", "meets goal")])


BENCHMARKS = {"launch": (bench_launch, launch_report)}


def run_benchmark(name: str, out_dir: str | Path = "bench-out") -> list[dict]:
    """Run benchmark `name`, print its table and write its JSON and plot into `out_dir`."""
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark must be one of {', '.join(sorted(BENCHMARKS))}; "
                         f"got {name!r}")
    measure, report = BENCHMARKS[name]
    rows = measure()
    print(report(rows, Path(out_dir)))
    print(f"(JSON and plot in {out_dir}/; medians on this machine, expect 10-30% run-to-run "
          "noise)")
    return rows
