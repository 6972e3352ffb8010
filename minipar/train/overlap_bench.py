"""`minipar bench dp-overlap`: how much of data parallelism's communication the backward
hides, inside the pipeline, measured.

The trainer's decoder (`small` preset, fp32, one thread per rank) on dp=2, and on pp=2 x
dp=2 with 4 micro-batches, each with the reduction at three moments: ZeRO-1
(reduce-scatter after backward), ZeRO-2 (each bucket's reduce-scatter on a
communication thread, queued inside the last micro-batch's backward) and DDP (bucket
all-reduces on a communication thread during that backward). Every step is traced, and
`hidden_and_exposed` splits its reductions into the time compute hid and the time it
exposed. The layouts take turns for `rounds` rounds; a row keeps the medians, and
ZeRO-2's step time over ZeRO-1's per round, whose spread is the noise. On 2 cores a
communication thread competes with the computing thread for the same cores, so hiding
is bounded by what a core has free; on a GPU the collectives run on their own stream.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..mesh.stage_data_parallel import hidden_and_exposed
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster, rank
from .config import load_config
from .data import BatchSampler, load_tokens
from .loop import build_part, train_step
from .precision import LossScaler

# row: (the mesh, the trainer's parallel overrides)
MESHES = {"dp=2": {"parallel.dp": 2},
          "pp=2 x dp=2, 4 micro-batches": {"parallel.pp": 2, "parallel.dp": 2,
                                           "parallel.microbatches": 4}}
MOMENTS = {"ZeRO-1, after backward": 1, "ZeRO-2, during backward": 2, "DDP, during backward": 0}
WARMUP = 2  # steps left out: the first ones learn shapes and allocate


def timed_steps(overrides: dict, steps: int, preset: str) -> dict:
    """On every rank: each step's seconds and its reductions' hidden and exposed seconds."""
    torch.set_num_threads(1)
    config = load_config(preset, {"train.steps": steps, "optim.warmup_steps": 1, **overrides})
    part = build_part(config)
    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    sampler = BatchSampler(tokens.train, config.model.seq_len, config.train.batch_size,
                           config.data.seed, part.dp_rank, part.dp)
    seconds, hidden, exposed = [], [], []
    for _ in range(steps):
        batch = sampler.next()
        torch.distributed.barrier()  # ranks start each step together
        with trace.capture(rank()) as captured:
            start = time.perf_counter()
            train_step(part, LossScaler(False), *batch, config, config.optim.lr)
            seconds.append(time.perf_counter() - start)
        h, e = hidden_and_exposed(captured.events)
        hidden.append(h)
        exposed.append(e)
    keep = slice(WARMUP, None)
    return {k: statistics.median(v[keep]) for k, v in
            (("seconds", seconds), ("hidden", hidden), ("exposed", exposed))}


def _ranks(mesh: str) -> int:
    return 4 if "parallel.pp" in MESHES[mesh] else 2  # pp x dp, or dp alone


def measure(steps: int = 8, rounds: int = 3, preset: str = "small",
            meshes: tuple[str, ...] = tuple(MESHES)) -> list[dict]:
    """Every mesh x moment in turns for `rounds` rounds (the slowest rank's step)."""
    unknown = [m for m in meshes if m not in MESHES]
    if unknown:
        raise ValueError(f"meshes must be among {', '.join(MESHES)}; got {unknown}")
    clusters = {k: Cluster(k, backend="gloo", timeout=300)
                for k in sorted({_ranks(m) for m in meshes})}
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for r in range(rounds):
            for mesh in meshes:
                for moment, zero in MOMENTS.items():
                    progress(f"{mesh}, {moment}, round {r + 1}/{rounds}")
                    result = clusters[_ranks(mesh)].run(
                        timed_steps, {**MESHES[mesh], "parallel.zero": zero}, steps, preset)
                    runs.setdefault((mesh, moment), []).append(
                        max(result, key=lambda x: x["seconds"]))
    finally:
        for cluster in clusters.values():
            cluster.close()
    rows = []
    for (mesh, moment), seen in runs.items():
        after = runs[(mesh, "ZeRO-1, after backward")]
        rows.append({"mesh": mesh, "moment": moment,
                     **{k: statistics.median(s[k] for s in seen)
                        for k in ("seconds", "hidden", "exposed")},
                     "vs_zero1": [a["seconds"] / b["seconds"]
                                  for a, b in zip(seen, after, strict=True)]})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """The table: step time, the reductions' hidden and exposed milliseconds, the step
    time against ZeRO-1's per round; JSON and a bar plot of hidden and exposed."""
    from matplotlib.figure import Figure

    table = format_table(
        [{**r, "step": f"{r['seconds'] * 1e3:.0f} ms", "hid": f"{r['hidden'] * 1e3:.1f} ms",
          "exp": f"{r['exposed'] * 1e3:.1f} ms", "ratio": ratio_cell(r["vs_zero1"])}
         for r in rows],
        [("mesh", "mesh"), ("moment", "reduction"), ("step", "step"),
         ("hid", "hidden"), ("exp", "exposed"), ("ratio", "step vs ZeRO-1")])
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    labels = [f"{r['mesh']}\n{r['moment']}" for r in rows]
    ax.barh(labels, [r["hidden"] * 1e3 for r in rows], label="hidden under compute")
    ax.barh(labels, [r["exposed"] * 1e3 for r in rows], left=[r["hidden"] * 1e3 for r in rows],
            label="exposed")
    ax.set_xlabel("data-parallel reduction per step (ms, slowest rank)")
    ax.legend(loc="lower right", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.92))  # room for the title save_results puts on top
    save_results(rows, fig, out_dir, "dp_overlap",
                 title="data parallelism's reduction per step: hidden under compute or exposed")
    return (f"{table}\nhidden: reduction time under the main thread's compute (F, B, W); "
            f"exposed: the rest; step vs ZeRO-1 = step time ratio per round, median "
            f"(min-max)")
