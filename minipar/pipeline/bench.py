"""`minipar bench pipeline`: two stages on two ranks against one process running both,
measured in turns; the measured bubble and step time beside the simulator's prediction
(fed the run's own per-rank F / B costs, the fitted machine's message time and the
engine's measured overhead per action); and the activation memory each rank really held
under GPipe and 1F1B."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import trace
from ..collectives import fit_machine
from ..models import linear_stack, mse
from ..report import format_table, progress, ratio_cell, save_results, spread
from ..runtime import Cluster, device, rank, world_size
from . import Pipeline, Schedule, peak_in_flight, schedule, simulate, split_model
from .simulate import costs_from_timeline

BUBBLE_WITHIN, STEP_WITHIN = 0.05, 0.15  # the simulator's goals against a measured run


def schedule_step_seconds(name: str, microbatches: int, virtual: int, width: int, batch: int,
                          layers_per_stage: int, steps: int) -> float:
    """Median seconds per training step of this schedule on this rank (Timeline recorded):
    `virtual` x `layers_per_stage` blocks of width `width` per rank, a batch of `batch`."""
    k = world_size()
    model = linear_stack(width, k * virtual * layers_per_stage)
    pipe = Pipeline(split_model(model, k * virtual), schedule(name, k, microbatches, virtual))
    x, y = torch.randn(batch, width, device=device()), torch.randn(batch, width, device=device())
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y, mse)
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _in_turns(name: str, microbatches: int, width: int, batch: int, layers_per_stage: int,
              rounds: int) -> dict:
    """Rounds of [one process runs both stages on rank 0 while rank 1 waits; the pipeline
    runs one step]: both see the same machine. Returns this rank's times per round."""
    torch.manual_seed(0)
    k = world_size()
    model = linear_stack(width, k * layers_per_stage)
    single = linear_stack(width, k * layers_per_stage)
    pipe = Pipeline(split_model(model, k), schedule(name, k, microbatches))
    x, y = torch.randn(batch, width, device=device()), torch.randn(batch, width, device=device())
    one, steps = [], []
    for _ in range(rounds + 1):  # round 0 warms up (and sends the shape headers)
        dist.barrier()
        if rank() == 0:
            start = time.perf_counter()
            mse(single(x), y).backward()
            one.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y, mse)
        steps.append(time.perf_counter() - start)
    return {"one": one[1:], "steps": steps[1:]}


def steps_of(timeline: trace.Timeline, plan: Schedule) -> list[trace.Timeline]:
    """The events of each step a run recorded, oldest first. Each rank is cut on its own
    clock: its step j starts at the earliest of its plan's actions' j-th occurrences
    (counted so that the last occurrences make the last step). Ranks agree on t=0 only as
    well as a barrier lets them, so one cut for all (say at each "0F0") can drop a rank's
    first action. Events before a rank's first cut are left out."""
    cuts: dict[int, list[float]] = {}
    for r in timeline.ranks:
        labels = {str(a) for a in plan.actions[r]}
        starts: dict[str, list[float]] = {}
        for e in timeline.for_rank(r):
            if e.label in labels:
                starts.setdefault(e.label, []).append(e.start)
        if starts:
            n = min(len(s) for s in starts.values())
            cuts[r] = [min(sorted(s)[len(s) - n + j] for s in starts.values())
                       for j in range(n)]
    n = min((len(c) for c in cuts.values()), default=0)
    steps: list[list[trace.Event]] = [[] for _ in range(n)]
    for r, mine in cuts.items():
        bounds = mine[len(mine) - n:] + [float("inf")]
        for e in timeline.for_rank(r):
            for j in range(n):
                if bounds[j] <= e.start < bounds[j + 1]:
                    steps[j].append(e)
                    break
    return [trace.Timeline(events) for events in steps]


def last_step(timeline: trace.Timeline, plan: Schedule) -> trace.Timeline:
    """The events of a run's final step (`steps_of`'s last)."""
    steps = steps_of(timeline, plan)
    return steps[-1] if steps else trace.Timeline([])


def predicted_vs_measured(timeline: trace.Timeline, plan, p2p: float) -> dict:
    """The simulator fed a measured step's own costs (`costs_from_timeline`: median F / B
    / I / W and the engine's overhead per action, per rank) and the fitted message time
    `p2p`, beside what was measured."""
    costs = {**costs_from_timeline(timeline, plan), "p2p": p2p}
    predicted = simulate(plan, costs)
    ideal = simulate(plan, {k: v for k, v in costs.items() if k in ("F", "B", "I", "W")})
    return {"bubble_measured": timeline.summary(plan.ranks).bubble_fraction,
            "bubble_predicted": predicted.summary(plan.ranks).bubble_fraction,
            "bubble_ideal": ideal.summary(plan.ranks).bubble_fraction,
            "step_predicted": predicted.makespan, "step_ideal": ideal.makespan,
            "costs": costs}


def _activation_peak(name: str, microbatches: int, width: int, batch: int,
                     layers_per_stage: int) -> int:
    """Peak bytes autograd kept for backward on this rank during one step of the schedule."""

    k = world_size()
    pipe = Pipeline(split_model(linear_stack(width, k * layers_per_stage), k),
                    schedule(name, k, microbatches), measure_activations=True)
    x = torch.randn(batch, width, device=device())
    pipe.train_step(x, x, lambda out, t: ((out - t) ** 2).mean())
    return pipe.activations.peak


def measure(microbatches: tuple[int, ...] = (1, 2, 4, 8, 16), width: int = 512,
            batch: int = 2048, layers_per_stage: int = 4, steps: int = 5) -> list[dict]:
    """Two pipeline stages vs one process running both, for each micro-batch count, in
    `steps` rounds each; the prediction for each; and, at the largest count, the
    activation memory each rank really held (GPipe vs 1F1B).

    The batch is large enough (2048 rows) that even 16 micro-batches keep matrix
    products efficient; with small micro-batches per-op overhead eats the gain.
    """
    rows = []
    with Cluster(2, backend="gloo") as cluster:
        progress("fitting the machine (message time)")
        machine = fit_machine(cluster, save=False)
        p2p = machine.p2p_seconds(batch * width * 4 / max(microbatches))
        for name in ("gpipe", "1f1b"):
            for m in microbatches:
                progress(f"{name}, m={m}: {steps} rounds, one process and pipeline in turns")
                run = cluster.run(_in_turns, name, m, width, batch, layers_per_stage, steps)
                per_round = [max(times) for times in zip(*(r["steps"] for r in run),
                                                         strict=True)]
                speedups = [one / step for one, step in zip(run[0]["one"], per_round,
                                                            strict=True)]
                last = [r["steps"][-1] for r in run]
                p2p = machine.p2p_seconds(batch * width * 4 / m)
                plan = schedule(name, 2, m)
                each = [predicted_vs_measured(step, plan, p2p)
                        for step in steps_of(run.timeline, plan)[-steps:]]
                compared = each[-1]
                # the bound per round, from that round's own F and B times: a round's
                # speedup can reach its bound only with free messages and no overhead, and
                # the median of the bounds is taken like the median of the speedups
                bounds = [one / c["step_ideal"] for one, c in zip(run[0]["one"][-len(each):],
                                                                  each, strict=True)]
                rows.append({"schedule": name, "microbatches": m,
                             "seconds": statistics.median(per_round), "seconds_last": max(last),
                             "speedups": speedups, "speedup": statistics.median(speedups),
                             "ceiling": 2 * m / (m + 1), "bubble_formula": 1 / (m + 1),
                             # what the ranks' own compute allows: no messages, no overhead
                             "speedup_bounds": bounds,
                             "speedup_bound": statistics.median(bounds),
                             "overhead_per_action": compared["costs"]["overhead"],
                             "p2p_seconds": p2p, **{k: v for k, v in compared.items()
                                                    if k != "costs"},
                             "costs": compared["costs"]})
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
    """Speedup (median and spread over rounds) and bubble and step time, measured and
    predicted, per micro-batch count; JSON and a plot against 2m/(m+1)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ms = sorted({r["microbatches"] for r in rows})
    ax.plot(ms, [2 * m / (m + 1) for m in ms], color="black", linestyle="--",
            label="ceiling 2m/(m+1)")
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == name]
        ax.errorbar([r["microbatches"] for r in mine], [r["speedup"] for r in mine],
                    yerr=[[r["speedup"] - min(r["speedups"]) for r in mine],
                          [max(r["speedups"]) - r["speedup"] for r in mine]],
                    marker="o", capsize=3, label=f"{name}, measured (median, min-max)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("speedup over one process")
    ax.legend(fontsize=8)
    save_results(rows, fig, out_dir, "pipeline",
                 title="2 pipeline stages on 2 CPU ranks: speedup over one process")
    shown = []
    for r in rows:
        error = r["seconds_last"] / r["step_predicted"] - 1
        shown.append({"schedule": r["schedule"], "m": r["microbatches"],
                      "speedup": ratio_cell(r["speedups"], r["ceiling"]),
                      "ceiling": f"{r['ceiling']:.2f}x",
                      "bound": f"{r['speedup_bound']:.2f}x",
                      "bubble": f"{r['bubble_measured']:.3f} / {r['bubble_predicted']:.3f} "
                                f"({r['bubble_ideal']:.3f})",
                      "step": f"{r['seconds_last'] * 1e3:.0f} / {r['step_predicted'] * 1e3:.0f}"
                              f" ms {error:+.0%}",
                      "overhead": spread([o * 1e6 for o in r["overhead_per_action"]], " us", 0)})
    bubble_errors = [abs(r["bubble_measured"] - r["bubble_predicted"]) for r in rows]
    step_errors = [abs(r["seconds_last"] / r["step_predicted"] - 1) for r in rows]
    verdict = (f"simulator vs measured: bubble within {BUBBLE_WITHIN} in "
               f"{sum(e <= BUBBLE_WITHIN for e in bubble_errors)} of {len(rows)} (largest "
               f"{max(bubble_errors):.3f}); step time within {STEP_WITHIN:.0%} in "
               f"{sum(e <= STEP_WITHIN for e in step_errors)} of {len(rows)} (largest "
               f"{max(step_errors):.0%})")
    memory = [r for r in rows if "activation_peak_bytes" in r]
    lines = []
    if len(memory) == 2:
        gpipe, one_f = memory
        for r in range(2):
            measured = gpipe["activation_peak_bytes"][r] / one_f["activation_peak_bytes"][r]
            counted = gpipe["in_flight"][r] / one_f["in_flight"][r]
            lines.append(f"  rank {r}: GPipe {gpipe['activation_peak_bytes'][r] / 2**20:.1f}"
                         f" MiB, 1F1B {one_f['activation_peak_bytes'][r] / 2**20:.1f} MiB: "
                         f"{measured:.2f}x measured, {counted:.2f}x by the simulator's counts "
                         f"({gpipe['in_flight'][r]} vs {one_f['in_flight'][r]} "
                         "micro-batches)")
    return ("speedup: one process / pipeline step, per round (one process and pipeline take "
            "turns), median (min-max); bubble and step: measured in the last round / "
            "predicted by the simulator with messages and engine overhead (and without them,"
            " in brackets); compute bound: per round, one process / the simulated step with "
            "that round's own F and B and nothing else, median over rounds; overhead: the "
            "engine's time per action, rank 0 and 1\n"
            + format_table(shown, [("schedule", "schedule"), ("m", "m"),
                                   ("speedup", "speedup (min-max)"),
                                   ("ceiling", "ceiling 2m/(m+1)"),
                                   ("bound", "compute bound"),
                                   ("bubble", "bubble meas. / pred. (ideal)"),
                                   ("step", "step meas. / pred."),
                                   ("overhead", "overhead/action")])
            + "\n" + verdict
            + (f"\npeak activation memory at m={memory[0]['microbatches']} (autograd's saved "
               "tensors):\n" + "\n".join(lines) if lines else ""))
