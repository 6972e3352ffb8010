"""`minipar bench collectives`: every all-reduce algorithm against torch's built-in, on
2 and 4 CPU ranks, beside the alpha-beta-gamma model fitted from a ping-pong."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives, trace
from ..cost import all_reduce_cost, fit_alpha_beta
from ..report import format_table, human_bytes, progress, save_results
from ..runtime import Cluster, rank

COLLECTIVE_SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB ... 64 MiB


PINGPONG_SIZES = [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _time_round_robin(algorithms: list[str], nbytes: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per all-reduce on this rank, the algorithms taking turns each round, so all
    see the same machine conditions (validation and tracing off, one warm-up each)."""


    tensor = torch.zeros(nbytes // 4)
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    previous = trace.set_recording(False)
    with collectives.validation(False):
        for round_index in range(rounds + 1):
            for algorithm in algorithms:
                dist.barrier()
                start = time.perf_counter()
                if algorithm == "torch":
                    dist.all_reduce(tensor)
                else:
                    collectives.all_reduce(tensor, algorithm=algorithm)
                if round_index:
                    times[algorithm].append(time.perf_counter() - start)
    trace.set_recording(previous)
    return times


def reduce_seconds_per_byte(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """gamma: seconds per byte for an in-place add, on one thread."""
    a, b = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)
    return best / nbytes


def pingpong(sizes: list[int], repeats: int = 5) -> list[float]:
    """One-way seconds for each message size between ranks 0 and 1 (half a round trip)."""
    one_way = []
    for nbytes in sizes:
        buffer = torch.zeros(max(nbytes // 4, 1))
        best = math.inf
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank() == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank() == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            best = min(best, time.perf_counter() - start)
        one_way.append(best / 2)
    return one_way


def fit_machine(cluster: Cluster, sizes: list[int] = PINGPONG_SIZES) -> tuple[float, float, float]:
    """alpha (seconds per message) and beta (seconds per byte) from a ping-pong between
    ranks 0 and 1 of `cluster`, and gamma (seconds per byte added) from one rank."""
    one_way = cluster.run(pingpong, sizes)[0]
    alpha, beta = fit_alpha_beta(sizes, one_way)
    return alpha, beta, cluster.run(reduce_seconds_per_byte)[0]


def measure(world_sizes: tuple[int, ...] = (2, 4),
                      sizes: list[int] | None = None) -> list[dict]:
    """All-reduce time and bus bandwidth per algorithm, size and K, with torch's for scale.

    Per (K, size) the algorithms take turns for several rounds; a rank-round's time is
    the slowest rank's; rows report medians, and ring vs torch as the median of the
    per-round ratios with their spread (the machine's noise, measured).
    """

    sizes = sizes or COLLECTIVE_SIZES
    algorithms = ["torch", *collectives.ALL_REDUCE_ALGORITHMS]
    rows = []
    for k in world_sizes:
        with Cluster(k, backend="gloo") as cluster:
            progress(f"K={k}: fitting alpha, beta (ping-pong) and gamma (additions)")
            alpha, beta, gamma = fit_machine(cluster)
            for nbytes in sizes:
                rounds = 15 if nbytes <= 1 << 20 else 7 if nbytes <= 16 << 20 else 5
                progress(f"K={k}, {human_bytes(nbytes)}: {rounds} rounds of "
                         f"{', '.join(algorithms)}")
                per_rank = cluster.run(_time_round_robin, algorithms, nbytes, rounds)
                slowest = {a: [max(ts) for ts in zip(*(r[a] for r in per_rank), strict=True)]
                           for a in algorithms}
                ratios = sorted(t / r for t, r in zip(slowest["torch"], slowest["ring"],
                                                      strict=True))
                for a in algorithms:
                    seconds = statistics.median(slowest[a])
                    model = None if a == "torch" else \
                        all_reduce_cost(a, k, nbytes, alpha, beta, gamma).seconds
                    rows.append({"world_size": k, "bytes": nbytes, "algorithm": a,
                                 "seconds": seconds, "rounds": rounds,
                                 "algbw_GBps": nbytes / seconds / 1e9,
                                 "busbw_GBps": nbytes / seconds / 1e9 * 2 * (k - 1) / k,
                                 "model_seconds": model, "alpha": alpha, "beta": beta,
                                 "gamma": gamma,
                                 "ring_vs_torch": statistics.median(ratios),
                                 "ring_vs_torch_range": [ratios[0], ratios[-1]]})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Bus bandwidth per algorithm (GB/s), ring vs torch, ring vs model; JSON and a plot."""
    from matplotlib.figure import Figure

    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    world_sizes = sorted({r["world_size"] for r in rows})
    by_key = {(r["world_size"], r["bytes"], r["algorithm"]): r for r in rows}
    table = []
    for k in world_sizes:
        for nbytes in sorted({r["bytes"] for r in rows if r["world_size"] == k}):
            line = {"K": k, "size": human_bytes(nbytes)}
            for a in algorithms:
                line[a] = f"{by_key[(k, nbytes, a)]['busbw_GBps']:.2f}"
            ring = by_key[(k, nbytes, "ring")]
            low, high = ring["ring_vs_torch_range"]
            line["ring/torch"] = f"{ring['ring_vs_torch']:.2f}x ({low:.2f}-{high:.2f})"
            line["ring/model"] = f"{ring['seconds'] / ring['model_seconds']:.2f}"
            table.append(line)
    fig = Figure(figsize=(10, 4), layout="constrained")
    for i, k in enumerate(world_sizes):
        ax = fig.add_subplot(1, len(world_sizes), i + 1)
        for a in algorithms:
            mine = sorted((r for r in rows if r["world_size"] == k and r["algorithm"] == a),
                          key=lambda r: r["bytes"])
            ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o",
                    label=a, linestyle="--" if a == "torch" else "-")
        ring = sorted((r for r in rows if r["world_size"] == k and r["algorithm"] == "ring"),
                      key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in ring],
                [r["bytes"] / r["model_seconds"] / 1e9 * 2 * (k - 1) / k for r in ring],
                color="black", linewidth=0.8, label="ring, alpha-beta model")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"all-reduce on {k} CPU ranks (gloo)", fontsize=10)
        ax.legend(fontsize=7)
    save_results(rows, fig, out_dir, "collectives")
    alpha, beta, gamma = rows[0]["alpha"], rows[0]["beta"], rows[0]["gamma"]
    columns = [("K", "K"), ("size", "size")] + [(a, a) for a in algorithms] + [
        ("ring/torch", "ring vs torch (range)"), ("ring/model", "ring time / model")]
    return (f"bus bandwidth in GB/s = size/time x 2(K-1)/K (higher is better); K={world_sizes[0]}: "
            f"alpha = {alpha * 1e6:.0f} us, 1/beta = {1 / beta / 1e9:.2f} GB/s (ping-pong), "
            f"1/gamma = {1 / gamma / 1e9:.1f} GB/s (additions)\n"
            "ring vs torch: median of per-round time ratios (min-max over rounds)\n"
            + format_table(table, columns))
