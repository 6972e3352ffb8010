"""`minipar bench masha`: distance to the saddle point against bytes sent per rank, for
uncompressed extragradient, naive compressed extragradient (Rand-k, Top-k), MASHA1 and
MASHA2 on one bilinear problem, on real ranks. Bytes are the meter's; the formula per
iteration is printed beside them. Rounds differ in the seed (Rand-k's draws, w's coin);
ratios to extragradient's bytes are per round, median (min-max)."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..report import format_table, progress, save_results, spread
from ..runtime import Cluster, world_size
from .masha import LABELS, METHODS, compare
from .saddle import bilinear_problem

N, K_KEPT, P = 50, 5, 0.1  # x and y of 50 entries (d = 100); k = 5 of 100 sent; p = 2k/d
TOLERANCE = 1e-6  # "reached": |z - z*| <= TOLERANCE x the start's distance


def _round(seed: int, n: int, k: int, p: float, steps: dict[str, int] | None) -> list[dict]:
    problem = bilinear_problem(n, world_size(), lam=1.0, spread=1.0)
    runs = compare(problem, k, p, METHODS, steps, seed)
    return [{"method": r.method, "distances": r.distances, "sent_bytes": r.sent_bytes,
             "reached": r.bytes_to_reach(TOLERANCE)} for r in runs]


def per_iteration_formula(method: str, ranks: int, d: int, k: int, p: float) -> float:
    """Bytes a rank sends per iteration, on paper: a ring all-reduce sends 2(K-1)/K of the
    d float64 entries; a ring all-gather of k (value, int32 index) pairs sends (K-1) x 12k;
    MASHA adds the full all-reduce with probability p."""
    dense, sparse = 2 * (ranks - 1) / ranks * 8 * d, (ranks - 1) * 12 * k
    return {"extragradient": 2 * dense, "rand-k": 2 * sparse, "top-k": 2 * sparse,
            "masha1": sparse + p * dense, "masha2": sparse + p * dense}[method]


def measure(rounds: int = 3, ranks: int = 2, n: int = N, k: int = K_KEPT, p: float = P,
            steps: dict[str, int] | None = None) -> list[dict]:
    """Every method on the same ranks, `rounds` times (seeds 0, 1, ...); one row per method:
    bytes to reach TOLERANCE per round, the final distance, and round 0's path."""
    per_round = []
    with Cluster(ranks, backend="gloo") as cluster:
        for seed in range(rounds):
            progress(f"round {seed + 1}/{rounds}: {', '.join(METHODS)}")
            per_round.append(cluster.run(_round, seed, n, k, p, steps)[0])  # rank 0's view
    rows = []
    for i, method in enumerate(METHODS):
        runs = [r[i] for r in per_round]
        base = [r[0]["reached"] for r in per_round]
        reached = [r["reached"] for r in runs]
        ratios = [m / b for m, b in zip(reached, base, strict=True) if m is not None and b]
        rows.append({"method": method, "ranks": ranks, "d": 2 * n, "k": k, "p": p,
                     "reached": reached, "ratios": ratios if len(ratios) == rounds else None,
                     "final": statistics.median(r["distances"][-1] / r["distances"][0]
                                                for r in runs),
                     "iterations": len(runs[0]["distances"]) - 1,
                     "formula": per_iteration_formula(method, ranks, 2 * n, k, p),
                     "distances": runs[0]["distances"], "sent_bytes": runs[0]["sent_bytes"]})
    return rows


def table(rows: list[dict]) -> str:
    """The bits table: bytes per rank to reach the tolerance, ratio to extragradient's."""
    shown = []
    for r in rows:
        hit = [b for b in r["reached"] if b is not None]
        shown.append({
            "method": LABELS[r["method"]],
            "bytes": (f"{statistics.median(hit):,.0f}" if len(hit) == len(r["reached"])
                      else "never"),
            "ratio": spread(r["ratios"]) if r["ratios"] else "-",
            "final": f"{r['final']:.1e}", "iterations": str(r["iterations"]),
            "formula": f"{r['formula']:,.0f}"})
    return format_table(shown, [("method", "method"),
                                ("bytes", f"bytes/rank to {TOLERANCE:g} x start"),
                                ("ratio", "vs extragradient"),
                                ("final", "final distance / start"),
                                ("iterations", "iterations"),
                                ("formula", "bytes/iteration (formula)")])


def figure(rows: list[dict]):
    """Distance to the saddle point (relative to the start) against bytes sent per rank."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.8), layout="constrained")
    ax = fig.add_subplot()
    for r in rows:
        ax.semilogy([b / 1e3 for b in r["sent_bytes"]],
                    [d / r["distances"][0] for d in r["distances"]], label=LABELS[r["method"]])
    ax.axhline(TOLERANCE, color="black", linewidth=0.8, linestyle=":")
    top = max(b for r in rows for b in r["sent_bytes"] if r["method"] == "extragradient")
    ax.set_xlim(0, 1.5 * top / 1e3)
    ax.set_ylim(TOLERANCE / 100, 1e2)
    ax.set_xlabel("kB sent per rank (metered)")
    ax.set_ylabel("|z - z*| / |z0 - z*|")
    ax.legend(fontsize=7)
    return fig


def report(rows: list[dict], out_dir: Path) -> str:
    save_results(rows, figure(rows), out_dir, "masha",
                 title=f"bilinear saddle point on {rows[0]['ranks']} CPU ranks, d = "
                       f"{rows[0]['d']}, k = {rows[0]['k']}: distance against bytes sent")
    return (f"d = {rows[0]['d']} entries of z = (x, y), k = {rows[0]['k']} sent compressed, "
            f"p = {rows[0]['p']:g}, {rows[0]['ranks']} ranks; bytes from the meter, ratios per "
            f"round (seed), median (min-max)\n" + table(rows))
