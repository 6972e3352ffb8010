"""`minipar bench mesh`: does the planner rank configurations as the real runs do?

A small decoder (`twin_check.MeshDecoder`: the trainer's layers, pipeline and data
parallelism) is trained with every (dp, pp, tp) that 4 and 8 CPU ranks allow; each
configuration's median step time (slowest rank) is measured, and the planner's estimate
for the same configuration is computed on a "cluster" fitted to this machine: alpha and
beta from a ping-pong (`minipar bench collectives`' fit), the compute rate from one
process training the same model, shared by the ranks when there are more ranks than
cores. The benchmark prints both rankings and their rank correlation (Spearman).

The planner counts a GPT-2 block (`cost.TransformerConfig`: multi-head attention, a 4h
GELU MLP). The decoder here has as many kv heads as heads and SwiGLU's 704 = 8/3 x 256
rounded up, whose three matrices do 3% more multiply-adds than GPT-2's two: the compute
rate is measured in the planner's FLOPs, so that difference cancels.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from matplotlib.figure import Figure

from .. import cost
from ..collectives import fit_machine
from ..decoder import Decoder, DecoderConfig, decoder
from ..report import format_table, progress, save_results
from ..runtime import Cluster, device
from .planner import OPTIMIZER_BYTES_PER_PARAM, Hardware, Layout, estimate
from .twin_check import MeshDecoder, connect

SHAPE = dict(vocab=256, hidden=256, heads=4, layers=4, seq_len=64)
BATCH, MICROBATCHES = 32, 4
MODEL = DecoderConfig(vocab_size=SHAPE["vocab"], layers=SHAPE["layers"], hidden=SHAPE["hidden"],
                      heads=SHAPE["heads"], kv_heads=SHAPE["heads"], seq_len=SHAPE["seq_len"])
LR = 1e-3


def _model() -> Decoder:
    return decoder(MODEL, seed=0)


def _config() -> cost.TransformerConfig:
    return cost.TransformerConfig(SHAPE["layers"], SHAPE["hidden"], SHAPE["heads"],
                                  SHAPE["seq_len"], SHAPE["vocab"])


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # a CPU generator draws on the host: moved just below
    ids, targets = (torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq_len"]),
                                  generator=gen) for _ in range(2))
    return ids.to(device()), targets.to(device())


def configurations(ranks: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) with dp * pp * tp = ranks that the model allows."""
    return [(ranks // (pp * tp), pp, tp) for pp in (1, 2, 4) for tp in (1, 2, 4)
            if ranks % (pp * tp) == 0 and SHAPE["layers"] % pp == 0
            and SHAPE["heads"] % tp == 0 and BATCH % (ranks // (pp * tp) * MICROBATCHES) == 0]


def time_steps(dims: dict[str, int], steps: int,
               around: Callable[[], AbstractContextManager] = nullcontext) -> list[float]:
    """This rank's seconds per training step, each timed from a barrier (one warm-up). The
    steps run inside `around()` (e.g. an emulated network), the model's building not."""
    model = MeshDecoder(_model(), connect(dims), microbatches=MICROBATCHES, lr=LR)
    ids, targets = _data()
    times = []
    with around():
        for i in range(steps + 1):
            # every rank starts the step together; step 0 (the warm-up) is not kept
            torch.distributed.barrier()
            start = time.perf_counter()
            model.train_step(ids, targets)
            if i:
                times.append(time.perf_counter() - start)
    return times


def compute_rates(steps: int = 3) -> tuple[float, float]:
    """On one process with a core to itself: (FLOP/s training the bench's model, counted
    by `cost.transformer_flops`; bytes/s of memory the Adam step streams, counted as the
    planner counts it)."""
    model, (ids, targets) = _model(), _data()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    passes, updates = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model.loss(ids, targets).backward()
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad()
        passes.append(middle - start)
        updates.append(time.perf_counter() - middle)
    flops = sum(cost.transformer_flops(_config()).values()) * BATCH * SHAPE["seq_len"]
    params = sum(p.numel() for p in model.parameters())
    # [1:]: the first pass is a warm-up (allocator, first-call overheads)
    return (flops / statistics.median(passes[1:]),
            params * OPTIMIZER_BYTES_PER_PARAM / statistics.median(updates[1:]))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation: 1 when both orders agree, -1 when reversed (ties share a rank)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                # ties share the mean of the ranks they span, as Spearman's rho usually takes them
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    norm = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / norm if norm else 0.0


def _on_rank_0(fn):
    """fn() on rank 0 while the others wait, so it has a core to itself."""
    out = fn() if torch.distributed.get_rank() == 0 else None
    torch.distributed.barrier()
    return out


def this_machine(ranks: int, flops: float, bandwidth: float, alpha: float,
                 beta: float) -> Hardware:
    """The planner's description of `ranks` CPU processes on this machine: one node whose
    links are the fitted loopback and whose compute and memory rates were measured with
    all ranks busy."""
    # beta is seconds per byte, so 1 / beta is the bandwidth; 1e12 bytes of memory: CPU ranks
    # never run out in the planner; efficiency 1.0, as the rates are measured, not peak
    return Hardware(1, ranks, flops, 1e12, 1 / beta, 1 / beta, intra_latency=alpha,
                   inter_latency=alpha, efficiency=1.0, memory_bandwidth=bandwidth,
                   cores=os.cpu_count() or 1, name="this machine")


def measure(world_sizes: tuple[int, ...] = (4, 8), steps: int = 3) -> list[dict]:
    rows = []
    for k in world_sizes:
        with Cluster(k, backend="gloo", timeout=120) as ranks:
            progress(f"K={k}: fitting alpha and beta (ping-pong) and the compute rates")
            fitted = fit_machine(ranks, save=False)
            alpha, beta = fitted.alpha, fitted.beta
            flops, bandwidth = ranks.run(_on_rank_0, compute_rates)[0]
            machine = this_machine(k, flops, bandwidth, alpha, beta)
            for dp, pp, tp in configurations(k):
                progress(f"K={k}: dp={dp} pp={pp} tp={tp}")
                per_rank = ranks.run(time_steps, dict(dp=dp, pp=pp, tp=tp), steps)
                slowest = [max(step) for step in zip(*per_rank, strict=True)]
                measured = statistics.median(slowest)
                layout = Layout(dp, pp, tp, micro_batch=BATCH // (dp * MICROBATCHES),
                                recompute="none")
                predicted = estimate(_config(), machine, BATCH, layout, bytes_per_value=4)
                rows.append({"world_size": k, "dp": dp, "pp": pp, "tp": tp, "alpha": alpha,
                             "beta": beta, "flops": flops, "bandwidth": bandwidth,
                             "measured": measured,
                             "measured_range": [min(slowest), max(slowest)],
                             "predicted": predicted.step,
                             **{f"predicted_{n}": s for n, s in predicted.seconds.items()}})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    lines, shown = [], []
    fig = Figure(figsize=(8, 3.4), layout="constrained")
    sizes = sorted({r["world_size"] for r in rows})
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    for ax, k in zip(axes, sizes, strict=True):
        same = [r for r in rows if r["world_size"] == k]
        rho = spearman([r["predicted"] for r in same], [r["measured"] for r in same])
        lines.append(f"K={k}: Spearman rank correlation, predicted vs measured = {rho:+.2f}")
        by_measured = sorted(same, key=lambda r: r["measured"])
        by_predicted = sorted(same, key=lambda r: r["predicted"])
        for r in same:
            ms = {n: f"{sum(r.get(f'predicted_{p}', 0.0) for p in parts) * 1e3:.0f}"
                  for n, parts in (("compute+bubble", ("compute", "bubble")),
                                   ("comm", ("tp", "pp", "dp")), ("opt", ("optimizer",)),
                                   ("share", ("sharing cores",)))}
            shown.append({"K": k, "config": f"dp={r['dp']} pp={r['pp']} tp={r['tp']}",
                          "measured": f"{r['measured'] * 1e3:.0f} ms ("
                          f"{r['measured_range'][0] * 1e3:.0f}-{r['measured_range'][1] * 1e3:.0f})",
                          "predicted": f"{r['predicted'] * 1e3:.0f} ms",
                          "m rank": by_measured.index(r) + 1,
                          "p rank": by_predicted.index(r) + 1, **ms})
            ax.scatter(r["predicted"] * 1e3, r["measured"] * 1e3, color="tab:blue")
            ax.annotate(f"{r['dp']}/{r['pp']}/{r['tp']}", (r["predicted"] * 1e3,
                                                          r["measured"] * 1e3), fontsize=7)
        top = max(max(r["predicted"], r["measured"]) for r in same) * 1e3 * 1.1
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--")
        ax.set(title=f"{k} ranks (dp/pp/tp), rho = {rho:+.2f}", xlabel="predicted ms",
               ylabel="measured ms")
    save_results(rows, fig, out_dir, "mesh",
                 title="decoder on every dp x pp x tp mesh: measured step time vs the planner's")
    header = ("step time of a 4-layer decoder (hidden 256, batch 32, 4 micro-batches) per "
              "configuration: measured (median of steps, each the slowest rank's; min-max) and "
              "the planner's estimate on this machine's fitted constants; ranks by each")
    return "\n".join([header, format_table(shown, [
        ("K", "K"), ("config", "config"), ("measured", "measured (min-max)"),
        ("predicted", "predicted"),
        ("m rank", "measured rank"), ("p rank", "predicted rank"),
        ("compute+bubble", "compute ms"), ("comm", "comm ms"), ("opt", "optimizer ms"),
        ("share", "waiting for a core ms")]),
        *lines])
