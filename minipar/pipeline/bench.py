"""`minipar bench pipeline`: two stages on two ranks against one process running both,
the measured bubble beside the simulator fed the run's own costs, and the activation
memory each rank really held under GPipe and 1F1B."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..models import linear_stack
from ..report import format_table, progress, save_results
from ..runtime import Cluster, world_size
from . import Pipeline, peak_in_flight, schedule, simulate, split_model


def schedule_step_seconds(name: str, microbatches: int, virtual: int, width: int, batch: int,
                    layers_per_stage: int, steps: int) -> float:
    """Median seconds per training step of this schedule on this rank (Timeline recorded):
    `virtual` x `layers_per_stage` blocks of width `width` per rank, a batch of `batch`."""

    k = world_size()
    model = linear_stack(width, k * virtual * layers_per_stage)
    pipe = Pipeline(split_model(model, k * virtual), schedule(name, k, microbatches, virtual))
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    times = []
    for step in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y, lambda out, t: ((out - t) ** 2).mean())
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _one_process_pipeline_model(stages: int, width: int, batch: int, layers_per_stage: int,
                                steps: int) -> float:
    torch.set_num_threads(1)
    model = linear_stack(width, stages * layers_per_stage)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        ((model(x) - y) ** 2).mean().backward()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_vs_ideal(timeline: trace.Timeline, plan) -> dict:
    """Bubble of a real run's Timeline beside the simulator's for the same schedule fed the
    run's own median F / B (/ I / W) costs."""
    last_step = max((e.step or 0) for e in timeline) if timeline.events else 0
    costs = {}
    for kind in ("F", "B", "I", "W"):
        durations = [e.duration for e in timeline if e.kind == kind]
        if durations:
            costs[kind] = statistics.median(durations)
    ideal = simulate(plan, costs).summary(plan.ranks).bubble_fraction
    measured = timeline.summary(plan.ranks).bubble_fraction
    return {"measured": measured, "ideal": ideal, "costs": costs, "steps": last_step}


def _activation_peak(name: str, microbatches: int, width: int, batch: int,
                     layers_per_stage: int) -> int:
    """Peak bytes autograd kept for backward on this rank during one step of the schedule."""

    k = world_size()
    pipe = Pipeline(split_model(linear_stack(width, k * layers_per_stage), k),
                    schedule(name, k, microbatches))
    x = torch.randn(batch, width)
    pipe.train_step(x, x, lambda out, t: ((out - t) ** 2).mean())
    return pipe.activations.peak


def measure(microbatches: tuple[int, ...] = (1, 2, 4, 8, 16), width: int = 512,
                   batch: int = 2048, layers_per_stage: int = 4, steps: int = 2) -> list[dict]:
    """Two pipeline stages vs one process running both, for each micro-batch count; and,
    at the largest count, the activation memory each rank really held (GPipe vs 1F1B).

    The batch is large enough (2048 rows) that even 16 micro-batches keep matrix
    products efficient; with small micro-batches per-op overhead eats the gain.
    """
    rows = []
    progress("one process running both stages")
    single = min(_one_process_pipeline_model(2, width, batch, layers_per_stage, steps)
                 for _ in range(2))
    with Cluster(2, backend="gloo") as cluster:
        for name in ("gpipe", "1f1b"):
            for m in microbatches:
                progress(f"{name}, m={m}")
                best = None
                for _ in range(2):
                    run = cluster.run(schedule_step_seconds, name, m, 1, width, batch,
                                      layers_per_stage, steps)
                    if best is None or max(run) < max(best):
                        best = run
                seconds = max(best)
                last = trace.Timeline(e for e in best.timeline if e.kind in ("F", "B"))
                # keep the final (measured, not warm-up) step: events after the last barrier
                cut = sorted(e.start for e in last if e.label == "0F0")[-1]
                compared = measured_vs_ideal(trace.Timeline(e for e in best.timeline
                                                            if e.start >= cut),
                                             schedule(name, 2, m))
                rows.append({"schedule": name, "microbatches": m, "seconds": seconds,
                             "speedup": single / seconds, "ceiling": 2 * m / (m + 1),
                             "bubble_measured": compared["measured"],
                             "bubble_ideal": compared["ideal"],
                             "bubble_formula": 1 / (m + 1)})
        m = max(microbatches)
        progress(f"activation memory, m={m}")
        for name in ("gpipe", "1f1b"):
            peaks = cluster.run(_activation_peak, name, m, width, batch, layers_per_stage)
            for row in rows:
                if row["schedule"] == name and row["microbatches"] == m:
                    row["activation_peak_bytes"] = list(peaks)
                    row["in_flight"] = peak_in_flight(schedule(name, 2, m))
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Speedup and bubble per micro-batch count; JSON and a plot against 2m/(m+1)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ms = sorted({r["microbatches"] for r in rows})
    ax.plot(ms, [2 * m / (m + 1) for m in ms], color="black", linestyle="--",
            label="ceiling 2m/(m+1)")
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == name]
        ax.plot([r["microbatches"] for r in mine], [r["speedup"] for r in mine], marker="o",
                label=f"{name}, measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("speedup over one process")
    ax.set_title("2 pipeline stages on 2 CPU ranks", fontsize=10)
    ax.legend(fontsize=8)
    save_results(rows, fig, out_dir, "pipeline")
    shown = [{"schedule": r["schedule"], "m": r["microbatches"],
              "speedup": f"{r['speedup']:.2f}x", "ceiling": f"{r['ceiling']:.2f}x",
              "measured": f"{r['bubble_measured']:.3f}", "ideal": f"{r['bubble_ideal']:.3f}",
              "formula": f"{r['bubble_formula']:.3f}"} for r in rows]
    memory = [r for r in rows if "activation_peak_bytes" in r]
    lines = []
    if len(memory) == 2:
        gpipe, one_f = memory
        for rank in range(2):
            measured = gpipe["activation_peak_bytes"][rank] / one_f["activation_peak_bytes"][rank]
            counted = gpipe["in_flight"][rank] / one_f["in_flight"][rank]
            lines.append(f"  rank {rank}: GPipe {gpipe['activation_peak_bytes'][rank] / 2**20:.1f}"
                         f" MiB, 1F1B {one_f['activation_peak_bytes'][rank] / 2**20:.1f} MiB: "
                         f"{measured:.2f}x measured, {counted:.2f}x by the simulator's counts "
                         f"({gpipe['in_flight'][rank]} vs {one_f['in_flight'][rank]} "
                         "micro-batches)")
    return ("bubble: measured from the run's Timeline; ideal = the simulator fed the run's own "
            "median F and B times; formula = (p-1)/(m+p-1)\n"
            + format_table(shown, [("schedule", "schedule"), ("m", "m"),
                                   ("speedup", "speedup"), ("ceiling", "ceiling 2m/(m+1)"),
                                   ("measured", "bubble measured"), ("ideal", "simulated"),
                                   ("formula", "formula")])
            + (f"\npeak activation memory at m={memory[0]['microbatches']} (autograd's saved "
               "tensors):\n" + "\n".join(lines) if lines else ""))
