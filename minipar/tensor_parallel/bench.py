"""`minipar bench tensor-parallel`: the decoder's SwiGLU (Megatron's MLP split) and its
whole block split over two ranks, against the same layer on one, at growing hidden
sizes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..decoder import DecoderBlock, DecoderConfig, SwiGLU, rope_tables
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster, device, world_size
from .parallel_block import ParallelDecoderBlock, ParallelSwiGLU

TP_HIDDEN = (256, 512, 1024, 1536)


def _tp_step_seconds(kind: str, hidden: int, tokens: int, steps: int) -> float:
    """Median forward+backward seconds of one block (parallel if world_size > 1)."""

    torch.manual_seed(0)
    # heads of 64, two query heads per kv head, SwiGLU's 8/3 x hidden: Llama's proportions
    config = DecoderConfig(hidden=hidden, heads=hidden // 64, kv_heads=hidden // 128,
                           seq_len=tokens // 4)
    rope: tuple = ()
    # seeded on the host, then moved: the same twin on any device
    twin = SwiGLU(hidden, config.ffn) if kind == "mlp" else DecoderBlock(config)
    twin = twin.to(device())
    if kind == "mlp":
        block = ParallelSwiGLU(twin) if world_size() > 1 else twin
    else:
        block = ParallelDecoderBlock(twin) if world_size() > 1 else twin
        rope = rope_tables(config.head_dim, torch.arange(config.seq_len, device=device()))
    x = torch.randn(4, tokens // 4, hidden, device=device())  # [batch, seq, hidden]
    times = []
    for step in range(steps + 1):
        # both ranks start the clock together: the slower rank's time is the step's
        torch.distributed.barrier()
        start = time.perf_counter()
        with trace.record("compute", f"{kind} step", step=step):
            block(x, *rope).sum().backward()
        # step 0 is a warm-up (allocator, first-call overheads): not timed
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(hidden_sizes: tuple[int, ...] = TP_HIDDEN, tokens: int = 256,
            steps: int = 3, rounds: int = 3) -> list[dict]:
    """TP = 2 vs one process for the SwiGLU MLP and the decoder block at several hidden sizes,
    taking turns for `rounds` rounds; each round's speedup is one ratio of the spread."""
    rows = []
    with Cluster(1, backend="gloo") as one, Cluster(2, backend="gloo") as two:
        for kind in ("mlp", "block"):
            for hidden in hidden_sizes:
                progress(f"{kind}, hidden {hidden}: {rounds} rounds in turns")
                singles, parallels = [], []
                for _ in range(rounds):
                    singles.append(one.run(_tp_step_seconds, kind, hidden, tokens, steps)[0])
                    # a parallel step ends when its slowest rank ends
                    parallels.append(max(two.run(_tp_step_seconds, kind, hidden, tokens, steps)))
                speedups = [s / p for s, p in zip(singles, parallels, strict=True)]
                rows.append({"block": kind, "hidden": hidden, "tokens": tokens,
                             "one_process_s": statistics.median(singles),
                             "tp2_s": statistics.median(parallels), "speedups": speedups,
                             "speedup": statistics.median(speedups)})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Speedup of TP = 2 over one process per block and hidden size; JSON and a plot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for kind in dict.fromkeys(r["block"] for r in rows):
        mine = [r for r in rows if r["block"] == kind]
        ax.plot([r["hidden"] for r in mine], [r["speedup"] for r in mine], marker="o", label=kind)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(2.0, color="#B0B0B0", linestyle="--", label="ideal on 2 cores")
    ax.set_xlabel("hidden size")
    ax.set_ylabel("speedup of TP=2 over one process")
    ax.legend(fontsize=8)
    save_results(rows, fig, out_dir, "tensor_parallel",
                 title="tensor parallelism, TP=2: speedup over one process by hidden size")
    shown = [{"block": r["block"], "hidden": r["hidden"],
              "one": f"{r['one_process_s'] * 1e3:.1f} ms", "tp2": f"{r['tp2_s'] * 1e3:.1f} ms",
              "speedup": ratio_cell(r["speedups"], 2.0)} for r in rows]
    return ("one process and TP=2 take turns; speedup per round, median (min-max); above 2x "
            "(two ranks) is noise\n"
            + format_table(shown, [("block", "block"), ("hidden", "hidden"),
                                   ("one", "one process"), ("tp2", "TP=2"),
                                   ("speedup", "speedup (min-max)")]))
