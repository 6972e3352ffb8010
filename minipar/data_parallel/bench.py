"""`minipar bench data-parallel`: minipar's trainers against one process and against
torch's DDP, at a compute-bound and a communication-bound size."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..models import mlp, mlp_parameters
from ..report import format_table, progress, save_results
from ..runtime import Cluster, world_size
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
    x = torch.randn(batch, sizes[0])
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


def measure(world_size: int = 2, steps: int = 8, rounds: int = 3) -> list[dict]:
    """Samples/s for one process and K ranks under each trainer, at two model sizes.

    The variants take turns for `rounds` rounds and each keeps its best round (noise
    on a shared machine only ever adds time); a round's time is its slowest rank's.
    """
    rows = []
    with Cluster(world_size, backend="gloo") as cluster:
        for name, (sizes, per_rank) in DP_SIZES.items():
            params = mlp_parameters(sizes)
            best: dict[str, dict] = {}
            for round_index in range(rounds):
                for variant in DP_VARIANTS:
                    progress(f"{name}: {variant}, round {round_index + 1}/{rounds}")
                    result = cluster.run(_dp_throughput, variant, sizes, per_rank, steps)
                    slowest = max(result, key=lambda r: r["seconds"])
                    if variant not in best or slowest["seconds"] < best[variant]["seconds"]:
                        best[variant] = slowest
            rows += [{"size": name, "params": params, "per_rank": per_rank, "variant": v,
                      **best[v]} for v in DP_VARIANTS]
    for row in rows:
        base = next(r for r in rows if r["size"] == row["size"] and r["variant"] == "one process")
        ddp = next(r for r in rows if r["size"] == row["size"] and r["variant"] == "torch DDP")
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        row["vs_ddp"] = row["samples_per_s"] / ddp["samples_per_s"]
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Samples/s, speedup over one process, ratio to DDP, communication share; JSON, plot."""
    from matplotlib.figure import Figure

    shown = [{"size": f"{r['size']} ({r['params'] / 1e6:.1f}M params, {r['per_rank']}/rank)",
              "variant": r["variant"], "samples/s": f"{r['samples_per_s']:.0f}",
              "speedup": f"{r['speedup']:.2f}x", "vs DDP": f"{r['vs_ddp']:.2f}x",
              "comm": "" if r["comm_share"] is None else f"{r['comm_share']:.0%}"} for r in rows]
    fig = Figure(figsize=(8, 3.5), layout="constrained")
    ax = fig.add_subplot()
    names = list(dict.fromkeys(r["size"] for r in rows))
    width = 0.8 / len(DP_VARIANTS)
    for i, variant in enumerate(DP_VARIANTS):
        values = [next(r["speedup"] for r in rows if r["size"] == n and r["variant"] == variant)
                  for n in names]
        ax.bar([j + i * width for j in range(len(names))], values, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("speedup over one process")
    ax.legend(fontsize=7)
    save_results(rows, fig, out_dir, "data_parallel")
    return format_table(shown, [("size", "model"), ("variant", "trainer"),
                                ("samples/s", "samples/s"), ("speedup", "vs one process"),
                                ("vs DDP", "vs torch DDP"), ("comm", "all-reduce share")])
