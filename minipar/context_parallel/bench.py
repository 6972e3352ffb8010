"""`minipar bench context-parallel`: causal attention's forward + backward on one process
against ring attention and Ulysses on two ranks, at growing sequence length; ring with
and without the balanced layout, and with and without overlapping its transfers."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster, device, rank, world_size
from .attention import attention, blocked_attention, positions
from .hetero import (
    assign_balanced,
    assign_even,
    predicted_step,
    run_assignment,
    sequence_cost,
    variable_lengths,
)
from .ring import RingWork, ring_attention
from .ulysses import ulysses_attention

HEADS, HEAD_DIM = 4, 64
METHODS = {"one process": None,
           "one process, blocked": "blocked",
           "ring, contiguous": dict(balanced=False, overlap=True),
           "ring, balanced": dict(balanced=True, overlap=True),
           "ring, balanced, no overlap": dict(balanced=True, overlap=False),
           "Ulysses": "ulysses"}


def _step_seconds(method: str, seq_len: int, steps: int) -> tuple[float, int]:
    """On one rank: median seconds of causal attention forward + backward over this rank's
    part of a [1, HEADS, seq_len, HEAD_DIM] float32 sequence, and the score entries the
    rank computed (ring only; 1 otherwise)."""
    k, me = world_size(), rank()
    setting = METHODS[method]
    balanced = isinstance(setting, dict) and setting["balanced"]
    pos = positions(me, k, seq_len, balanced)
    # one seed on every rank: each draws the same whole sequence and keeps its own positions
    gen = torch.Generator().manual_seed(0)
    # a CPU generator draws on the host: moved just below
    q, kk, v = (torch.randn(1, HEADS, seq_len, HEAD_DIM, generator=gen)[..., pos, :]
                .to(device()).requires_grad_() for _ in range(3))
    times, work = [], RingWork()
    for step in range(steps + 1):
        if k > 1:
            # all ranks start the clock together
            torch.distributed.barrier()
        start = time.perf_counter()
        if setting is None:
            out = attention(q, kk, v, causal=True)
        elif setting == "blocked":  # the ring's 2K = 4 chunks, masked ones skipped
            out = blocked_attention(q, kk, v, 4, causal=True)
        elif setting == "ulysses":
            out = ulysses_attention(q, kk, v, causal=True)
        else:
            work = RingWork()
            out = ring_attention(q, kk, v, causal=True, **setting, work=work)
        out.sum().backward()
        # step 0 is a warm-up: not timed
        if step:
            times.append(time.perf_counter() - start)
    # ring: the score entries this rank computed; the others split work evenly by design
    return statistics.median(times), work.forward if isinstance(setting, dict) else 1


def _fit_cost(cluster: Cluster, repeats: int = 3) -> tuple[float, float]:
    """(per_token, per_pair) seconds of the block's forward + backward on one rank, from
    four short and four long sequences (best of a few runs): cost(L) = a L + b L^2
    through both points."""
    def seconds(length: int) -> float:
        runs = [cluster.run(run_assignment, [[0, 1, 2, 3]], [length] * 4, [1.0])[0][0]
                for _ in range(repeats)]
        # the best of a few runs: noise only ever adds time
        return min(runs) / 4

    short, long_ = 64, 512
    t_short, t_long = seconds(short), seconds(long_)
    # t / L = a + b L: two points give the slope b and the intercept a
    b = (t_long / long_ - t_short / short) / (long_ - short)
    # clamped at 0: a noisy fit must not give a negative cost
    return max(t_short / short - b * short, 0.0), max(b, 0.0)


def measure_placement(count: int = 32, speeds: tuple[float, ...] = (1.0, 0.5),
                      repeats: int = 3) -> list[dict]:
    """Variable-length sequences on ranks of different speeds: the even split against the
    balanced one (planned on costs fitted here), predicted and measured step, the two
    placements taking turns for `repeats` rounds."""
    lengths = variable_lengths(count, seed=5)
    rows = []
    with Cluster(1, backend="gloo") as one, Cluster(len(speeds), backend="gloo") as many:
        per_token, per_pair = _fit_cost(one)
        plans = (("even", assign_even(lengths, len(speeds))),
                 ("balanced", assign_balanced(lengths, list(speeds), per_token, per_pair)))
        times: dict[str, list[float]] = {name: [] for name, _ in plans}
        for round_index in range(repeats):  # the placements take turns
            for name, assignment in plans:
                progress(f"placement {name}, round {round_index + 1}/{repeats}")
                # a synchronous step ends when its slowest rank does
                times[name].append(max(r[0] for r in many.run(run_assignment, assignment,
                                                               lengths, list(speeds))))
        for name, assignment in plans:
            loads = [sum(sequence_cost(lengths[i], per_token, per_pair) for i in seqs) / s
                     for seqs, s in zip(assignment, speeds, strict=True)]
            rows.append({"placement": name, "sequences": [len(a) for a in assignment],
                         "tokens": [sum(lengths[i] for i in a) for a in assignment],
                         "predicted": predicted_step(assignment, lengths, list(speeds),
                                                     per_token, per_pair),
                         "predicted_loads": loads, "measured": statistics.median(times[name]),
                         "vs_even_rounds": [e / t for e, t in zip(times["even"], times[name],
                                                                  strict=True)]})
    return rows


def measure(lengths: tuple[int, ...] = (512, 1024, 2048, 4096), steps: int = 3) -> list[dict]:
    """Per sequence length and method: the slowest rank's median step, its speedup over
    one process, and the largest and smallest per-rank share of the score entries; then
    the placement of variable-length sequences on uneven ranks."""
    return measure_attention(lengths, steps) + measure_placement()


def measure_attention(lengths: tuple[int, ...] = (512, 2048), steps: int = 3,
                      rounds: int = 3) -> list[dict]:
    """Causal attention forward + backward per sequence length: one process (the whole
    score matrix, then blocked like the ring with masked blocks skipped), then each
    two-rank method, taking turns for `rounds` rounds; the slowest rank's median step
    (median over rounds) and its per-round speedup over each baseline."""
    rows = []
    with Cluster(1, backend="gloo") as one, Cluster(2, backend="gloo") as two:
        for seq_len in lengths:
            times: dict[str, list[float]] = {method: [] for method in METHODS}
            work: dict[str, list[int]] = {}
            for round_index in range(rounds):
                for method in METHODS:
                    progress(f"S={seq_len} {method}, round {round_index + 1}/{rounds}")
                    alone = method.startswith("one process")
                    run = (one if alone else two).run(_step_seconds, method, seq_len, steps)
                    times[method].append(max(r[0] for r in run))
                    work[method] = [r[1] for r in run]
            for method, mine in times.items():
                speedups = [w / t for w, t in zip(times["one process"], mine, strict=True)]
                blocked = None if method == "one process" else [
                    b / t for b, t in zip(times["one process, blocked"], mine, strict=True)]
                rows.append({"seq_len": seq_len, "method": method, "ranks": len(work[method]),
                             "seconds": statistics.median(mine), "speedups": speedups,
                             "speedup": statistics.median(speedups),
                             "vs_blocked_rounds": blocked,
                             "vs_blocked": None if blocked is None
                             else statistics.median(blocked),
                             "work_imbalance": max(work[method]) / min(work[method])
                             if min(work[method]) else None})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """The tables, a JSON file and a plot of speedup against sequence length."""
    from matplotlib.figure import Figure

    placement = [r for r in rows if "placement" in r]
    rows = [r for r in rows if "placement" not in r]
    fig = Figure(figsize=(6, 3.2), layout="constrained")
    ax = fig.add_subplot()
    for method in list(METHODS)[1:]:
        mine = [r for r in rows if r["method"] == method]
        ax.plot([r["seq_len"] for r in mine], [r["vs_blocked"] for r in mine], marker="o",
                label=method)
    ax.axhline(2, color="#B0B0B0", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("speedup vs one process, blocked")
    ax.legend(fontsize=7)
    save_results(rows + placement, fig, out_dir, "context_parallel",
                 title="context parallelism on 2 ranks: speedup over one process (blocked) by "
                       "sequence length")
    shown = [{"S": r["seq_len"], "method": r["method"], "ranks": r["ranks"],
              "time": f"{r['seconds'] * 1e3:.1f} ms", "speedup": ratio_cell(r["speedups"]),
              "blocked": "-" if r["vs_blocked"] is None
              else ratio_cell(r["vs_blocked_rounds"], 2.0 if r["ranks"] == 2 else None),
              "work": "-" if r["work_imbalance"] is None or r["ranks"] == 1
              else f"{r['work_imbalance']:.2f}"} for r in rows]
    return ("causal attention, forward + backward, [1, 4 heads, S, 64] float32; "
            "time = slowest rank's median; methods take turns, ratios per round, median "
            "(min-max)\n"
            + format_table(shown, [("S", "S"), ("method", "method"), ("ranks", "ranks"),
                                   ("time", "time"), ("speedup", "vs one process"),
                                   ("blocked", "vs one process, blocked"),
                                   ("work", "busiest / idlest rank's score entries")])
            + "\n\n" + format_placement(placement))


def format_placement(rows: list[dict]) -> str:
    """The placement table: sequences and tokens per rank, predicted and measured step."""
    if not rows:
        return ""
    shown = [{"placement": r["placement"], "seqs": " / ".join(map(str, r["sequences"])),
              "tokens": " / ".join(map(str, r["tokens"])),
              "predicted": f"{r['predicted'] * 1e3:.0f} ms",
              "measured": f"{r['measured'] * 1e3:.0f} ms",
              "vs": ratio_cell(r["vs_even_rounds"])} for r in rows]
    return ("variable-length sequences (forward + backward of a decoder block) on 2 ranks "
            "of speed 1 and 1/2 (the slow rank computes twice); step = slowest rank\n"
            + format_table(shown, [("placement", "placement"), ("seqs", "sequences per rank"),
                                   ("tokens", "tokens per rank"), ("predicted", "predicted"),
                                   ("measured", "measured"), ("vs", "speedup vs even")]))
