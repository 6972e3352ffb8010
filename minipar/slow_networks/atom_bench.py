"""`minipar bench atom`: swapping a whole model through each peer (ATOM) against pipelining
it over the network (SWARM), on the same emulated links, across a sweep of bandwidths.

ATOM: 2 peers, each swapping the whole model through a device budget smaller than the
model, averaging with CO2 every `LOCAL_STEPS` steps. SWARM: a trainer and one worker per
stage (2 stages), 4 micro-batches. Both train the same model on the same global batch per
step, so samples/s compare directly; on each link they take turns, and the ratio is per
round, median (min-max). Beside it, the cost model's ratio (`atom.atom_seconds` and
`atom.swarm_seconds` from each one's loopback step) and the bandwidth where it crosses 1.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from ..collectives import meter, slow_network
from ..cost import Link
from ..models import linear_stack, mse
from ..pipeline.engine import split_model
from ..pipeline.swarm import swarm
from ..report import format_table, progress, save_results, spread
from ..runtime import Cluster, device, rank
from .atom import SwarmTraffic, atom_seconds, crossover, swarm_seconds, swarm_traffic, train_atom

WIDTH, BLOCKS, BATCH, MICRO, LOCAL_STEPS, PEERS, LR = 128, 8, 64, 4, 4, 2, 0.05
LATENCY = 5e-4  # seconds per message on every emulated link
BANDWIDTHS = (math.inf, 1e9, 1e8, 1e7, 3e6)  # bytes/s; inf: plain loopback
BUDGET = 400 << 10  # bytes of "device" per ATOM peer: the model's parameters alone are 528 KiB


def bench_model() -> torch.nn.Sequential:
    return linear_stack(WIDTH, BLOCKS, seed=0)


def bench_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # a CPU generator draws on the host: moved just below
    drawn = [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
             for _ in range(steps)]
    return [(x.to(device()), y.to(device())) for x, y in drawn]


def model_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in bench_model().parameters())


def traffic() -> SwarmTraffic:
    """What SWARM's protocol sends per step for the bench's model and batch."""
    stages = split_model(bench_model(), 2)
    boundary = BATCH * WIDTH * 4  # float32 activations of the whole batch at every cut
    return swarm_traffic([boundary] * 3,
                         [sum(p.numel() * 4 for p in s.parameters()) for s in stages], MICRO, 4)


def _per_step(seconds: list[float]) -> float:
    """Mean seconds per step over one steady round, steps H to 2H-1: the first round warms
    up and has no average to wait for; the last step waits for the final average, which no
    later round hides; the round between pays one average landing, as every round would."""
    return statistics.mean(seconds[LOCAL_STEPS:2 * LOCAL_STEPS])


def _atom(steps: int, latency: float, bandwidth: float, swap: bool = True) -> dict:
    with slow_network(latency, bandwidth):
        report, _ = train_atom(bench_model, bench_batches(steps), mse, LR, LOCAL_STEPS,
                               "co2", swap=swap, budget=BUDGET if swap else None)
    # bytes: one average per LOCAL_STEPS steps, as in a long run (this one ends on an extra)
    return {"seconds": _per_step(report.seconds),
            "sent": report.sent_bytes / report.rounds / LOCAL_STEPS, "peak": report.peak}


def _swarm(steps: int, latency: float, bandwidth: float) -> dict | int:
    with slow_network(latency, bandwidth), meter() as m:
        report = swarm(bench_model, [[1], [2]], bench_batches(steps), mse, LR, MICRO)
    if rank() != 0:
        return m.sent_bytes
    return {"seconds": _per_step(report.seconds), "sent": m.sent_bytes}


def _link(bandwidth: float) -> str:
    return "loopback" if bandwidth == math.inf else f"{bandwidth * 8 / 1e6:g} Mb/s"


def measure(rounds: int = 3, steps: int = 2 * LOCAL_STEPS + 1,
            bandwidths: tuple[float, ...] = BANDWIDTHS, latency: float = LATENCY) -> list[dict]:
    """ATOM and SWARM in turns on each link, `rounds` times; one row per bandwidth (the
    first must be math.inf: the cost model starts from the loopback steps). On loopback
    ATOM also runs in memory (the model fits): what swapping costs."""
    if steps < 2 * LOCAL_STEPS + 1:
        raise ValueError(f"steps must be at least {2 * LOCAL_STEPS + 1} (a round to warm up, "
                         f"a steady round, the last step); got {steps!r}")
    if not bandwidths or bandwidths[0] != math.inf:
        raise ValueError(f"bandwidths must start with math.inf (loopback, the cost model's "
                         f"base); got {bandwidths!r}")
    runs = {b: {"atom": [], "swarm": []} for b in bandwidths}
    in_memory = []
    with Cluster(PEERS, backend="gloo") as peers, Cluster(3, backend="gloo") as pipeline:
        peers.run(_atom, steps, latency, math.inf)  # warm-up: the ranks' first run is slower
        pipeline.run(_swarm, steps, latency, math.inf)
        for r in range(rounds):
            for b in bandwidths:
                progress(f"{_link(b)}, round {r + 1}/{rounds}")
                if b == math.inf:
                    in_memory.append(peers.run(_atom, steps, latency, b, False)[0]["seconds"])
                runs[b]["atom"].append(peers.run(_atom, steps, latency, b)[0])
                done = pipeline.run(_swarm, steps, latency, b)
                # bytes: the trainer's and both workers', per step
                runs[b]["swarm"].append({**done[0], "sent": (done[0]["sent"] + sum(done[1:]))
                                         / steps})
    base = {k: statistics.median(run["seconds"] for run in runs[math.inf][k])
            for k in ("atom", "swarm")}
    size, sent = model_bytes(), traffic()

    def atom_model(link: Link) -> float:
        return atom_seconds(base["atom"], size, PEERS, LOCAL_STEPS, link)

    def swarm_model(link: Link) -> float:
        return swarm_seconds(base["swarm"], sent, link)

    where = crossover(atom_model, swarm_model, latency)
    rows = []
    for b in bandwidths:
        atom_s = [run["seconds"] for run in runs[b]["atom"]]
        swarm_s = [run["seconds"] for run in runs[b]["swarm"]]
        link = Link(latency, b)
        rows.append({"bandwidth": b, "latency": latency,
                     "atom_samples_per_s": BATCH / statistics.median(atom_s),
                     "swarm_samples_per_s": BATCH / statistics.median(swarm_s),
                     "ratio_rounds": [s / a for s, a in zip(swarm_s, atom_s, strict=True)],
                     "model_ratio": swarm_model(link) / atom_model(link),
                     "atom_bytes_per_step": 2 * statistics.median(
                         run["sent"] for run in runs[b]["atom"]),  # both peers
                     "swarm_bytes_per_step": statistics.median(
                         run["sent"] for run in runs[b]["swarm"]),
                     "atom_peak": runs[b]["atom"][0]["peak"], "model_bytes": size,
                     "crossover": str(where), "swarm_formula_bytes": sent.nbytes,
                     "swap_cost_rounds": [a / m for a, m in zip(
                         [run["seconds"] for run in runs[math.inf]["atom"]], in_memory,
                         strict=True)]})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Samples/s of each, the per-round ratio, the model's ratio, bytes per step."""
    from matplotlib.figure import Figure

    shown = [{"link": _link(r["bandwidth"]),
              "atom": f"{r['atom_samples_per_s']:.0f}",
              "swarm": f"{r['swarm_samples_per_s']:.0f}",
              "ratio": spread(r["ratio_rounds"]), "model": f"{r['model_ratio']:.2f}x",
              "atom_kib": f"{r['atom_bytes_per_step'] / 1024:.0f}",
              "swarm_kib": f"{r['swarm_bytes_per_step'] / 1024:.0f}"} for r in rows]
    fig = Figure(figsize=(6, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ticks = range(len(rows))
    ax.plot(ticks, [r["atom_samples_per_s"] for r in rows], "o-", label="ATOM (swap, CO2)")
    ax.plot(ticks, [r["swarm_samples_per_s"] for r in rows], "s-", label="SWARM (pipeline)")
    ax.set_xticks(list(ticks), [s["link"] for s in shown])
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (median)")
    ax.legend()
    save_results(rows, fig, out_dir, "atom",
                 title="Swapping the model (ATOM) vs pipelining it (SWARM) against link speed")
    first = rows[0]
    header = (f"{BLOCKS} blocks of width {WIDTH} ({first['model_bytes'] / 1024:.0f} KiB of "
              f"float32 parameters), batch {BATCH}, latency {first['latency'] * 1e3:g} ms "
              f"per message. ATOM: {PEERS} peers, each swapping the model through "
              f"{BUDGET / 1024:.0f} KiB (peak {first['atom_peak'] / 1024:.0f} KiB), CO2 "
              f"every {LOCAL_STEPS} steps. SWARM: trainer + 1 worker per stage, 2 stages, "
              f"{MICRO} micro-batches (formula {first['swarm_formula_bytes'] / 1024:.0f} "
              "KiB/step).\nATOM/SWARM = samples/s ratio per round, median (min-max); model = "
              "the cost model's ratio from each one's loopback step")
    table = format_table(shown, [
        ("link", "link"), ("atom", "ATOM samples/s"), ("swarm", "SWARM samples/s"),
        ("ratio", "ATOM/SWARM"), ("model", "model"), ("atom_kib", "ATOM KiB/step"),
        ("swarm_kib", "SWARM KiB/step")])
    return (header + "\n" + table + "\npredicted crossover: " +
            first["crossover"] + "\nswapping's cost where the model fits: "
            f"ATOM's loopback step {spread(first['swap_cost_rounds'])} the same peers' in "
            "memory")
