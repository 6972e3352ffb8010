"""`minipar bench train`: the trainer's tokens per second and MFU on this machine, one
process against dp=2, fp32 against bf16, the `small` preset.

Every rank computes on one thread, and so does the one-process baseline, so "dp=2 on 2
cores" compares like with like; a one-process row on every core is shown too, so that
nobody is misled about what one process can do. The variants take turns for `rounds`
rounds; a row keeps the median round and the per-round ratios, whose spread is the
noise. MFU divides by the peak measured for the dtype on one thread (metrics.py).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster
from .config import load_config
from .loop import train

# name: (ranks, precision, threads per rank)
VARIANTS = {"1 process, fp32": (1, "fp32", 1), "1 process, bf16": (1, "bf16", 1),
            "dp=2, fp32": (2, "fp32", 1), "dp=2, bf16": (2, "bf16", 1),
            "1 process, fp32, every core": (1, "fp32", os.cpu_count() or 1)}
WARMUP = 2  # steps left out of the median: the first ones pay for allocation


def _timed_run(config, threads: int) -> dict:
    """Median tokens/s and MFU of a short run on this rank, on `threads` threads."""
    torch.set_num_threads(threads)
    records = train(config).records[WARMUP:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "mfu": statistics.median(r["mfu"] for r in records)}


def measure(steps: int = 12, rounds: int = 3, preset: str = "small") -> list[dict]:
    """Each variant's median tokens/s and MFU, the variants in turns for `rounds` rounds."""
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    clusters = {k: Cluster(k, backend="gloo") for k in {v[0] for v in VARIANTS.values()}}
    try:
        for round_index in range(rounds):
            for name, (ranks, precision, threads) in VARIANTS.items():
                progress(f"{name}, round {round_index + 1}/{rounds}")
                config = load_config(preset, {
                    "parallel.dp": ranks, "train.precision": precision, "train.steps": steps,
                    "optim.warmup_steps": 1, "train.eval_every": 0, "train.eval_batches": 1})
                result = clusters[ranks].run(_timed_run, config, threads)
                runs[name].append(min(result, key=lambda r: r["tokens_per_s"]))
    finally:
        for cluster in clusters.values():
            cluster.close()
    base = runs["1 process, fp32"]
    rows = []
    for name, (ranks, precision, threads) in VARIANTS.items():
        speeds = [r["tokens_per_s"] for r in runs[name]]
        rows.append({"variant": name, "ranks": ranks, "precision": precision,
                     "threads": threads, "tokens_per_s": statistics.median(speeds),
                     "tokens_per_s_range": [min(speeds), max(speeds)],
                     "mfu": statistics.median(r["mfu"] for r in runs[name]),
                     "vs_one_process": [mine["tokens_per_s"] / one["tokens_per_s"]
                                        for one, mine in zip(base, runs[name], strict=True)]})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Tokens/s, MFU and the per-round ratio to one fp32 process; JSON and a bar plot."""
    from matplotlib.figure import Figure

    shown = [{"variant": r["variant"], "tokens/s": f"{r['tokens_per_s']:,.0f}",
              "mfu": f"{r['mfu']:.0%}", "ratio": ratio_cell(r["vs_one_process"])}
             for r in rows]
    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.add_subplot()
    ax.barh([r["variant"] for r in rows][::-1], [r["tokens_per_s"] for r in rows][::-1],
            xerr=[[r["tokens_per_s"] - r["tokens_per_s_range"][0] for r in rows][::-1],
                  [r["tokens_per_s_range"][1] - r["tokens_per_s"] for r in rows][::-1]],
            color="#4C72B0", capsize=2)
    ax.set_xlabel("tokens per second (median of rounds, min-max)")
    save_results(rows, fig, out_dir, "train",
                 title="the trainer on this machine: tokens/s by ranks and precision")
    return ("the variants take turns; each rank (and the baseline) on one thread unless "
            "said; ratios per round, median (min-max)\n"
            + format_table(shown, [("variant", "variant"), ("tokens/s", "tokens/s"),
                                   ("mfu", "MFU"), ("ratio", "vs 1 process, fp32")]))
