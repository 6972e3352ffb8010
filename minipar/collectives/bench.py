"""`minipar bench collectives`: every all-reduce algorithm (and the pipelined ring)
against torch's built-in, on 2 and 4 CPU ranks, beside the machine model
(`minipar.machine`) fitted in the same run."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives, trace
from ..machine import Machine
from ..report import format_table, human_bytes, progress, save_results, spread
from ..runtime import Cluster, device
from .fit import fit_machine

COLLECTIVE_SIZES = [1 << 10 << (2 * i) for i in range(9)]  # 1 KiB ... 64 MiB
PIPELINED = "pipelined ring"  # collectives.pipelined_ring_all_reduce, timed beside the rest
WITHIN = 0.25  # the model's goal: every algorithm's median within 25% of its prediction
# a shared host's speed drifts over minutes: the machine is fitted again on the same ranks
# before a size once the last fit is this old. Fitting before every size spent 28 of lesson
# 01's 34 s fitting, for sizes timed a few seconds apart.
REFIT_AFTER_S = 30.0


def _time_round_robin(algorithms: list[str], nbytes: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per all-reduce on this rank, the algorithms taking turns each round, so all
    see the same machine conditions (validation and tracing off, one warm-up each)."""


    tensor = torch.zeros(nbytes // 4, device=device())  # float32: 4 bytes an element
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    previous = trace.set_recording(False)
    with collectives.validation(False):
        for round_index in range(rounds + 1):
            for algorithm in algorithms:
                dist.barrier()  # all ranks start together: a round is its slowest rank's time
                start = time.perf_counter()
                if algorithm == "torch":
                    dist.all_reduce(tensor)
                elif algorithm == PIPELINED:
                    collectives.pipelined_ring_all_reduce(tensor)
                else:
                    collectives.all_reduce(tensor, algorithm=algorithm)
                if round_index:  # round 0 is the warm-up, not kept
                    times[algorithm].append(time.perf_counter() - start)
    trace.set_recording(previous)
    return times


def measure(world_sizes: tuple[int, ...] = (2, 4),
            sizes: list[int] | None = None) -> list[dict]:
    """All-reduce time per algorithm, size and K, with torch's for scale, and the fitted
    model's prediction for each.

    The machine is fitted on the same ranks at most `REFIT_AFTER_S` before each size is
    timed (a shared host's speed drifts over minutes, so a fit from the start of the run
    is stale by the end); the first fit is saved for the other models. Per (K, size) the
    algorithms take turns for several rounds; a round's time is the slowest rank's; rows
    keep the median with min and max, and ring vs torch as the median of the per-round
    ratios with their spread (the machine's noise, measured).
    """

    sizes = sizes or COLLECTIVE_SIZES
    algorithms = ["torch", *collectives.ALL_REDUCE_ALGORITHMS, PIPELINED]
    rows = []
    fits = 0  # rows measured against the same fit share its number
    for k in world_sizes:
        with Cluster(k, backend="gloo") as cluster:
            fitted_at = -float("inf")
            for index, nbytes in enumerate(sizes):
                if time.monotonic() - fitted_at > REFIT_AFTER_S:
                    progress(f"K={k}, {human_bytes(nbytes)}: fitting alpha, beta (ping-pong) "
                             "and gamma (additions)")
                    machine = fit_machine(cluster, save=index == 0)
                    fitted_at, fits = time.monotonic(), fits + 1
                # small messages are bimodal on shared cores: more rounds steady the median
                rounds = 41 if nbytes <= 256 << 10 else 15 if nbytes <= 1 << 20 \
                    else 7 if nbytes <= 16 << 20 else 5
                progress(f"K={k}, {human_bytes(nbytes)}: {rounds} rounds of "
                         f"{', '.join(algorithms)}")
                per_rank = cluster.run(_time_round_robin, algorithms, nbytes, rounds)
                slowest = {a: [max(ts) for ts in zip(*(r[a] for r in per_rank), strict=True)]
                           for a in algorithms}
                ratios = {a: sorted(t / r for t, r in zip(slowest["torch"], slowest[a],
                                                          strict=True))
                          for a in ("ring", PIPELINED)}
                for a in algorithms:
                    seconds = statistics.median(slowest[a])
                    model = None if a in ("torch", PIPELINED) \
                        else machine.all_reduce_seconds(a, k, nbytes)
                    rows.append({"world_size": k, "bytes": nbytes, "algorithm": a,
                                 "seconds": seconds, "seconds_range": [min(slowest[a]),
                                                                       max(slowest[a])],
                                 "rounds": rounds,
                                 "algbw_GBps": nbytes / seconds / 1e9,
                                 "busbw_GBps": nbytes / seconds / 1e9 * 2 * (k - 1) / k,
                                 "model_seconds": model,
                                 "model_error": None if model is None else seconds / model - 1,
                                 "alpha": machine.alpha, "beta": machine.beta,
                                 "gamma": machine.gamma, "cores": machine.cores,
                                 "busy_alpha": machine.busy_alpha,
                                 "busy_beta": machine.busy_beta,
                                 "busy_ranks": machine.busy_ranks, "fit": fits,
                                 "vs_torch": ratios.get(a)})
    return rows


def _grid(rows: list[dict], algorithms: list[str], cell) -> list[dict]:
    """One table line per (K, size): a cell per algorithm, `cell(row)` of its row."""
    by_key = {(r["world_size"], r["bytes"], r["algorithm"]): r for r in rows}
    return [{"K": k, "size": human_bytes(n), **{a: cell(by_key[(k, n, a)]) for a in algorithms}}
            for k, n in sorted({(r["world_size"], r["bytes"]) for r in rows})]


def _bandwidth_table(rows: list[dict], algorithms: list[str]) -> str:
    table = _grid(rows, algorithms, lambda r: f"{r['busbw_GBps']:.2f}")
    versus = _grid(rows, ["ring", PIPELINED], lambda r: spread(r["vs_torch"]))
    for line, ratios in zip(table, versus, strict=True):
        line["ring/torch"], line["pipelined/torch"] = ratios["ring"], ratios[PIPELINED]
    columns = [("K", "K"), ("size", "size")] + [(a, a) for a in algorithms] + [
        ("ring/torch", "ring vs torch"), ("pipelined/torch", "pipelined vs torch")]
    return format_table(table, columns)


def _prediction_table(rows: list[dict]) -> tuple[str, str]:
    modelled = [r for r in rows if r["model_seconds"] is not None]
    algorithms = list(dict.fromkeys(r["algorithm"] for r in modelled))
    table = _grid(modelled, algorithms, lambda r: f"{r['seconds'] * 1e3:.2f} / "
                  f"{r['model_seconds'] * 1e3:.2f} {r['model_error']:+.0%}")
    errors = sorted(abs(r["model_error"]) for r in modelled)
    inside = sum(e <= WITHIN for e in errors)
    verdict = (f"model vs measured: {inside} of {len(errors)} within {WITHIN:.0%}; median "
               f"|error| {statistics.median(errors):.0%}, largest {errors[-1]:.0%}")
    return format_table(table, [("K", "K"), ("size", "size")] + [(a, a) for a in algorithms]), \
        verdict


def _ring_bound(rows: list[dict]) -> str:
    """Why the ring (pipelined or not) cannot beat gloo here: at the largest size, the time
    the fitted machine gives the ring's bytes alone (no latency, no additions), and the
    additions, which are all a pipelined ring could hide, beside the measured times."""
    lines = []
    for k in sorted({r["world_size"] for r in rows}):
        n = max(r["bytes"] for r in rows if r["world_size"] == k)
        by = {r["algorithm"]: r for r in rows if r["world_size"] == k and r["bytes"] == n}
        r = by["ring"]
        fitted = Machine("gloo", r["alpha"], r["beta"], r["gamma"], r["cores"],
                         r["busy_ranks"], r["busy_alpha"], r["busy_beta"])
        bytes_only = replace(fitted, alpha=0.0, gamma=0.0, busy_alpha=0.0)
        adding = fitted.all_reduce_seconds("ring", k, n) \
            - replace(fitted, gamma=0.0).all_reduce_seconds("ring", k, n)
        lines.append(f"K={k}, {human_bytes(n)}: the ring's bytes alone on this machine take "
                     f"{bytes_only.all_reduce_seconds('ring', k, n) * 1e3:.1f} ms and its "
                     f"additions {adding * 1e3:.1f} ms; measured ring {r['seconds'] * 1e3:.1f} "
                     f"ms, pipelined ring {by[PIPELINED]['seconds'] * 1e3:.1f} ms, "
                     f"torch's gloo {by['torch']['seconds'] * 1e3:.1f} ms")
    return "\n".join(lines)


def report(rows: list[dict], out_dir: Path) -> str:
    """Bus bandwidth per algorithm, ring vs torch, and measured vs predicted time per
    algorithm; JSON and a plot (bandwidth, and predicted against measured)."""
    from matplotlib.figure import Figure

    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    world_sizes = sorted({r["world_size"] for r in rows})
    fig = Figure(figsize=(12, 4), layout="constrained")
    for i, k in enumerate(world_sizes):
        ax = fig.add_subplot(1, len(world_sizes) + 1, i + 1)
        for a in algorithms:
            mine = sorted((r for r in rows if r["world_size"] == k and r["algorithm"] == a),
                          key=lambda r: r["bytes"])
            ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o",
                    label=a, linestyle="--" if a == "torch" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"all-reduce on {k} CPU ranks (gloo)", fontsize=10)
        ax.legend(fontsize=7)
    plot_predictions(fig.add_subplot(1, len(world_sizes) + 1, len(world_sizes) + 1), rows)
    save_results(rows, fig, out_dir, "collectives",
                 title="all-reduce algorithms: bus bandwidth by size, and measured vs "
                       "the fitted model")
    table, verdict = _prediction_table(rows)
    fits = {r["fit"]: r for r in rows}.values()  # each fit once, however many sizes used it
    alphas = [r["alpha"] * 1e6 for r in fits]
    links = [1 / r["beta"] / 1e9 for r in fits]
    adds = [1 / r["gamma"] / 1e9 for r in fits]
    how_many = f"{len(fits)} fit" + "s" * (len(fits) != 1)
    return (f"fitted at most {REFIT_AFTER_S:.0f} s before each size ({how_many}): alpha = "
            f"{spread(alphas, ' us', 0)} per message, 1/beta = {spread(links, ' GB/s')} "
            f"(ping-pong), 1/gamma = {spread(adds, ' GB/s', 1)} "
            f"(additions), {rows[0]['cores']} cores\n"
            "bus bandwidth in GB/s = size/time x 2(K-1)/K (higher is better); ring (pipelined) vs "
            "torch: median of per-round time ratios (min-max over rounds)\n"
            + _bandwidth_table(rows, algorithms)
            + "\nmeasured / predicted ms (median of rounds, slowest rank) and the error\n"
            + table + "\n" + verdict + "\n" + _ring_bound(rows))


def plot_predictions(ax, rows: list[dict]) -> None:
    """Measured against predicted seconds, log-log, one colour per algorithm, with the
    line where they agree and the band of the 25% goal."""
    modelled = [r for r in rows if r["model_seconds"] is not None]
    for a in dict.fromkeys(r["algorithm"] for r in modelled):
        for k, marker in zip(sorted({r["world_size"] for r in modelled}), "os^D", strict=False):
            mine = [r for r in modelled if r["algorithm"] == a and r["world_size"] == k]
            ax.scatter([r["model_seconds"] for r in mine], [r["seconds"] for r in mine],
                       s=14, marker=marker, label=f"{a}, K={k}")
    low = min(min(r["model_seconds"], r["seconds"]) for r in modelled)
    high = max(max(r["model_seconds"], r["seconds"]) for r in modelled)
    line = [low, high]
    ax.plot(line, line, color="black", linewidth=0.8)
    ax.fill_between(line, [v * (1 - WITHIN) for v in line], [v * (1 + WITHIN) for v in line],
                    color="grey", alpha=0.2, label=f"within {WITHIN:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted (s)")
    ax.set_ylabel("measured (s)")
    ax.set_title("all-reduce: measured vs the fitted model", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
