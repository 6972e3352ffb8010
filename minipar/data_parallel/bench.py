"""`minipar bench data-parallel`: minipar's trainers against one process and against
torch's DDP, at a compute-bound and a communication-bound size."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..models import mlp, mlp_parameters
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster, device, world_size
from .ddp import DataParallel

DP_SIZES = {  # name: (layer sizes, samples per rank): compute-bound vs communication-bound
    "compute-bound": ([256, 512, 512, 256], 512),
    "communication-bound": ([1024, 1536, 1536, 1024], 8),
}


DP_VARIANTS = ("one process", "per-parameter", "bucketed", "bucketed+overlap", "torch DDP")


DDP_BUCKET_BYTES = 25 << 20  # torch DDP's default bucket_cap_mb, for a like-for-like comparison


def _dp_throughput(variant: str, sizes: list[int], per_rank: int, steps: int) -> dict:
    """Samples/s of one variant (one process runs the whole K x per_rank batch itself)."""
    from torch.nn.parallel import DistributedDataParallel


    model = mlp(sizes, seed=0)
    k = world_size()
    batch = per_rank * (k if variant == "one process" else 1)
    if variant == "torch DDP":
        wrapped = DistributedDataParallel(model)
    elif variant in ("per-parameter", "bucketed", "bucketed+overlap"):
        wrapped = DataParallel(model, bucket_bytes=None if variant == "per-parameter"
                               else DDP_BUCKET_BYTES, overlap=variant == "bucketed+overlap")
    else:
        wrapped = model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, sizes[0], device=device())
    times = []
    with trace.capture() as captured:
        for step in range(steps + 2):
            torch.distributed.barrier()
            start = time.perf_counter()
            with trace.record("compute", "step", step=step):
                loss = ((wrapped(x) - x[:, : sizes[-1]]) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            if step >= 2:
                times.append(time.perf_counter() - start)
    measured = [e for e in captured.events if e.kind == "compute" and (e.step or 0) >= 2]
    begin = min(e.start for e in measured)
    comm = trace.union_length([(e.start, e.end) for e in captured.events
                               if e.kind == "all_reduce" and e.start >= begin])
    step_time = statistics.median(times)
    return {"seconds": step_time, "samples_per_s": per_rank * k / step_time,
            "comm_share": comm / sum(e.duration for e in measured)
            if variant not in ("one process", "torch DDP") else None}


def measure(world_size: int = 2, steps: int = 8, rounds: int = 5) -> list[dict]:
    """Samples/s for one process and K ranks under each trainer, at two model sizes.

    The variants take turns for `rounds` rounds, so each round compares them on the same
    machine; a round's time is its slowest rank's median step. Rows keep the median
    round and the per-round ratios to one process and to DDP, whose spread is the noise.
    """
    rows = []
    with Cluster(world_size, backend="gloo") as cluster:
        for name, (sizes, per_rank) in DP_SIZES.items():
            params = mlp_parameters(sizes)
            runs: dict[str, list[dict]] = {v: [] for v in DP_VARIANTS}
            for round_index in range(rounds):
                for variant in DP_VARIANTS:
                    progress(f"{name}: {variant}, round {round_index + 1}/{rounds}")
                    result = cluster.run(_dp_throughput, variant, sizes, per_rank, steps)
                    runs[variant].append(max(result, key=lambda r: r["seconds"]))
            for variant in DP_VARIANTS:
                seconds = [r["seconds"] for r in runs[variant]]
                middle = sorted(runs[variant], key=lambda r: r["seconds"])[len(seconds) // 2]
                shares = [r["comm_share"] for r in runs[variant] if r["comm_share"] is not None]
                rows.append({
                    "size": name, "params": params, "per_rank": per_rank, "variant": variant,
                    "world_size": world_size, "seconds": middle["seconds"],
                    "seconds_range": [min(seconds), max(seconds)],
                    "samples_per_s": middle["samples_per_s"],
                    "comm_share": statistics.median(shares) if shares else None,
                    "speedups": [one["seconds"] / mine["seconds"] for one, mine  # same samples
                                 in zip(runs["one process"], runs[variant], strict=True)],
                    "vs_ddps": [ddp["seconds"] / mine["seconds"] for ddp, mine
                                in zip(runs["torch DDP"], runs[variant], strict=True)]})
    for row in rows:
        row["speedup"] = statistics.median(row["speedups"])
        row["vs_ddp"] = statistics.median(row["vs_ddps"])
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Samples/s, speedup over one process and ratio to DDP (median and min-max over
    rounds; a speedup above K is flagged as noise), communication share; JSON, plot."""
    from matplotlib.figure import Figure

    shown = [{"size": f"{r['size']} ({r['params'] / 1e6:.1f}M params, {r['per_rank']}/rank)",
              "variant": r["variant"], "samples/s": f"{r['samples_per_s']:.0f}",
              "speedup": ratio_cell(r["speedups"], float(r["world_size"])),
              "vs DDP": ratio_cell(r["vs_ddps"]),
              "comm": "" if r["comm_share"] is None else f"{r['comm_share']:.0%}"} for r in rows]
    fig = Figure(figsize=(8, 3.5), layout="constrained")
    ax = fig.add_subplot()
    names = list(dict.fromkeys(r["size"] for r in rows))
    width = 0.8 / len(DP_VARIANTS)
    for i, variant in enumerate(DP_VARIANTS):
        mine = [next(r for r in rows if r["size"] == n and r["variant"] == variant)
                for n in names]
        ax.bar([j + i * width for j in range(len(names))], [r["speedup"] for r in mine], width,
               yerr=[[r["speedup"] - min(r["speedups"]) for r in mine],
                     [max(r["speedups"]) - r["speedup"] for r in mine]],
               capsize=2, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("speedup over one process")
    ax.legend(fontsize=7)
    save_results(rows, fig, out_dir, "data_parallel",
                 title=f"data parallelism on {rows[0]['world_size']} CPU ranks: speedup over "
                       "one process (median, min-max)")
    return ("per round the trainers take turns; ratios are per round, median (min-max)\n"
            + format_table(shown, [("size", "model"), ("variant", "trainer"),
                                   ("samples/s", "samples/s"), ("speedup", "vs one process"),
                                   ("vs DDP", "vs torch DDP"), ("comm", "all-reduce share")]))
