"""`minipar bench moe`: an MoE layer against a dense FFN of the same active size, and
expert parallelism on two ranks against the whole layer on one."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..models import FFN
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster, device, rank, world_size
from .expert_parallel import ExpertParallelMoE
from .layer import MoELayer


def _moe_step(model: str, tokens: int, hidden: int, ffn: int, experts: int, k: int,
              steps: int) -> tuple[float, float]:
    """Median seconds per forward+backward of `model` ("dense" or "moe"; expert-parallel
    on more than one rank), and the share spent in all-to-all (EP only)."""

    torch.manual_seed(0)
    # seeded on the host, then moved: the same layer on any device
    # a dense FFN has the same active parameters as k experts
    layer = FFN(hidden, k * ffn) if model == "dense" else \
        MoELayer(hidden, ffn, experts, k, capacity_factor=1.25)
    layer = layer.to(device())
    if model != "dense" and world_size() > 1:
        layer = ExpertParallelMoE(layer)
    local = tokens // world_size()
    x = torch.randn(tokens, hidden, device=device())[rank() * local:(rank() + 1) * local]
    times = []
    with trace.capture() as captured:
        for step in range(steps + 1):
            torch.distributed.barrier()
            start = time.perf_counter()
            layer(x).pow(2).mean().backward()
            if step:
                times.append(time.perf_counter() - start)
    first = min(e.start for e in captured.events) if captured.events else 0.0
    exchange = trace.union_length([(e.start, e.end) for e in captured.events
                                   if e.kind == "all_to_all" and e.start >= first])
    return statistics.median(times), exchange / (sum(times) * (steps + 1) / steps)


def layer_label(model: str, ranks: int) -> str:
    """A row's display name, derived from its keys: "moe, EP=2" for the MoE on 2 ranks."""
    return model if ranks == 1 else f"{model}, EP={ranks}"


def measure(tokens: int = 4096, hidden: int = 256, ffn: int = 512, experts: int = 8,
            k: int = 2, steps: int = 3, systems: bool = True, rounds: int = 3) -> list[dict]:
    """Tokens/s: dense FFN (same active size), MoE on one process, MoE with EP = 2, taking
    turns for `rounds` rounds (ratios per round, median and min-max); with `systems`,
    then the systems papers' layers and the flat vs hierarchical exchange
    (systems_bench.py, tagged part="systems" / "exchange")."""
    rows = []
    cases = (("dense", 1), ("moe", 1), ("moe", 2))  # (model, ranks): the rows' keys
    runs: dict[tuple[str, int], list] = {case: [] for case in cases}
    with Cluster(1, backend="gloo") as one, Cluster(2, backend="gloo") as two:
        for round_index in range(rounds):  # the layers take turns: same machine per round
            for model, ranks in cases:
                progress(f"{layer_label(model, ranks)}, round {round_index + 1}/{rounds}")
                runs[model, ranks].append((one if ranks == 1 else two).run(
                    _moe_step, model, tokens, hidden, ffn, experts, k, steps))
    slowest = {case: [max(r[0] for r in run) for run in runs[case]] for case in cases}
    for model, ranks in cases:
        mine = slowest[model, ranks]
        seconds = statistics.median(mine)
        rows.append({"model": model, "ranks": ranks, "layer": layer_label(model, ranks),
                     "tokens_per_s": tokens / seconds, "seconds": seconds,
                     "all_to_all_share": statistics.median(max(r[1] for r in run)
                                                           for run in runs[model, ranks])
                     if ranks > 1 else None,
                     "vs_dense_rounds": [d / t for d, t in zip(slowest["dense", 1], mine,
                                                               strict=True)],
                     "vs_one_rounds": [o / t for o, t in zip(slowest["moe", 1], mine,
                                                             strict=True)]})
    for row in rows:
        row["vs_dense"] = statistics.median(row["vs_dense_rounds"])
        row["vs_one_process_moe"] = statistics.median(row["vs_one_rounds"])
    if systems:
        from .adaptive_bench import measure_adaptive
        from .systems_bench import measure_exchange, measure_systems

        rows += [{"part": "systems", **r} for r in measure_systems()]
        rows += [{"part": "exchange", **r} for r in measure_exchange()]
        rows += [{"part": "adaptive", **r} for r in measure_adaptive()]
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Tokens/s table (and the systems tables when measured); JSON and a bar plot."""
    from matplotlib.figure import Figure

    from .adaptive_bench import report_adaptive
    from .systems_bench import report_systems

    everything = rows
    systems = [r for r in rows if r.get("part") == "systems"]
    exchange = [r for r in rows if r.get("part") == "exchange"]
    adaptive = [r for r in rows if r.get("part") == "adaptive"]
    rows = [r for r in rows if "part" not in r]
    fig = Figure(figsize=(5, 3), layout="constrained")
    ax = fig.add_subplot()
    ax.bar([r["layer"] for r in rows], [r["tokens_per_s"] for r in rows],
           color=["#8C8C8C", "#4C72B0", "#55A868"])
    ax.set_ylabel("tokens / s (forward + backward)")
    save_results(everything, fig, out_dir, "moe",
                 title="tokens/s: an MoE layer, a dense FFN of its active size, and the MoE "
                       "expert-parallel")
    shown = [{"layer": r["layer"], "tps": f"{r['tokens_per_s']:.0f}",
              "dense": ratio_cell(r["vs_dense_rounds"]),
              "one": ratio_cell(r["vs_one_rounds"], float(r["ranks"]) if r["ranks"] > 1
                                else None),  # the ceiling: EP on K ranks is at most K x
              "a2a": "" if r["all_to_all_share"] is None else f"{r['all_to_all_share']:.0%}"}
             for r in rows]
    table = "layers take turns; ratios per round, median (min-max)\n" + format_table(
        shown, [("layer", "layer"), ("tps", "tokens/s"), ("dense", "vs dense FFN"),
                ("one", "vs MoE on one process"), ("a2a", "all-to-all share")])
    if not systems:
        return table
    return "\n\n".join([table, report_systems(systems, exchange), report_adaptive(adaptive)])
