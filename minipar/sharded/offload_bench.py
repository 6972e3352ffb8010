"""`minipar bench offload`: a model trained in memory, with its states and activations
offloaded to the host without prefetch, with prefetch, and under KARMA's plan; step time
ratios (the variants take turns, per-round ratios) and the device peak of each."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from ..models import mse
from ..report import format_table, progress, save_results, spread
from ..runtime import Cluster, device
from ..trace import Timeline, capture
from . import karma
from .memory_tracker import MemoryTracker
from .offload import Offload, hidden_fraction, timeline_rows

WIDTH, BLOCKS, BATCH = 512, 8, 512
VARIANTS = ("in memory", "offload, no prefetch", "offload + prefetch", "KARMA plan")


def offload_model(width: int = WIDTH, blocks: int = BLOCKS, dtype: torch.dtype = torch.float32,
                  seed: int = 0) -> nn.Sequential:
    """Blocks that alternate a matmul (Linear then tanh: many FLOPs per byte it saves) and a
    normalization (LayerNorm then tanh: almost none), the two kinds of layer KARMA weighs."""
    torch.manual_seed(seed)
    # seeded on the host, then moved: the same weights anywhere
    model = nn.Sequential(*[
        nn.Sequential(nn.Linear(width, width, dtype=dtype) if i % 2 == 0
                      else nn.LayerNorm(width, dtype=dtype), nn.Tanh())
        for i in range(blocks)])
    return model.to(device())


def batch(rows: int = BATCH, width: int = WIDTH, dtype: torch.dtype = torch.float32,
          seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # drawn on the host: the same batch on any device
    x = torch.randn(rows, width, generator=g, dtype=dtype)
    y = torch.randn(rows, width, generator=g, dtype=dtype)
    return x.to(device()), y.to(device())


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def karma_plan(model: nn.Module, x: torch.Tensor, share: float = 0.5,
               copy: karma.Link | None = None, compute: karma.Compute | None = None
               ) -> karma.SwapPlan:
    """KARMA's plan for `model` on `x` when the activations may keep `share` of what they
    would; the copy link and the compute are fitted here unless given."""
    layers = karma.profile(model, x)
    copy = copy or karma.fit_copy()
    compute = compute or karma.fit_compute(model, x)
    return karma.plan(layers, copy, compute, int(share * sum(p.saved_bytes for p in layers)))


def trainer(variant: str, model: nn.Module, choices: list[str] | None = None):
    """(callable model, step function, MemoryTracker of the device) for one variant."""
    if variant == "in memory":
        opt = _adam(model.parameters())

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, step, MemoryTracker(model, opt)
    activations = choices if variant == "KARMA plan" else "swap"
    off = Offload(model, _adam, activations, states="host",
                  prefetch=variant != "offload, no prefetch")
    return off, off.step, off.tracker()


def _run(variant: str, steps: int, choices: list[str] | None) -> dict:
    torch.manual_seed(0)
    model = offload_model()
    x, y = batch()
    run, step, tracker = trainer(variant, model, choices)
    times = []
    with capture() as c:
        for i in range(steps + 2):  # step 0 warms up, step 1 is watched for memory
            start = time.perf_counter()
            if i == 1:
                with tracker.watch():
                    mse(run(x), y).backward()
            else:
                mse(run(x), y).backward()
            step()
            if i >= 2:
                times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak": tracker.peak().total,
            "hidden": hidden_fraction(c.timeline)}


def _plan() -> list[str]:
    x, _ = batch()
    return karma_plan(offload_model(), x).choices


def measure(steps: int = 3, rounds: int = 5) -> list[dict]:
    """Each variant on one CPU rank, in turns for `rounds` rounds; KARMA's plan fitted on
    that rank first."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with Cluster(1, backend="gloo") as cluster:
        choices = cluster.run(_plan)[0]
        for r in range(rounds):
            for variant in VARIANTS:
                progress(f"{variant}, round {r + 1}/{rounds}")
                runs[variant].append(cluster.run(_run, variant, steps, choices)[0])
    base = [run["seconds"] for run in runs["in memory"]]
    rows = []
    for variant in VARIANTS:
        seconds = [run["seconds"] for run in runs[variant]]
        rows.append({"variant": variant, "seconds": statistics.median(seconds),
                     "vs_memory_rounds": [s / b for s, b in zip(seconds, base, strict=True)],
                     "peak": runs[variant][0]["peak"],
                     "hidden": statistics.median(run["hidden"] for run in runs[variant]),
                     "plan": " ".join(c[0] for c in choices) if variant == "KARMA plan"
                     else ""})
    for row in rows:
        row["peak_vs_memory"] = row["peak"] / rows[0]["peak"]
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    """Step time against in memory (median, min-max of per-round ratios), device peak."""
    from matplotlib.figure import Figure

    shown = [{"variant": r["variant"], "step": f"{r['seconds'] * 1e3:.1f} ms",
              "ratio": spread(r["vs_memory_rounds"]), "peak": f"{r['peak'] / 2**20:.2f}",
              "share": f"{r['peak_vs_memory']:.0%}",
              "hidden": "-" if r["variant"] == "in memory" else f"{r['hidden']:.0%}",
              "plan": r["plan"]} for r in rows]
    fig = Figure(figsize=(8, 3), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = [r["variant"] for r in rows]
    left.barh(names, [r["seconds"] * 1e3 for r in rows], color="tab:blue")
    left.set_xlabel("step (ms, median)")
    right.barh(names, [r["peak"] / 2**20 for r in rows], color="tab:orange")
    right.set_xlabel("device peak (MiB)")
    right.set_yticks([])
    save_results(rows, fig, out_dir, "offload",
                 title="Offloading to the host: step time and device peak")
    header = (f"{BLOCKS} blocks of width {WIDTH}, batch {BATCH}, float32, Adam, one CPU rank; "
              "step = median; vs memory = step time ratio per round, median (min-max); "
              "copy hidden = share of copy time under compute; plan: k(eep) s(wap) "
              "r(ecompute) per layer")
    return header + "\n" + format_table(shown, [
        ("variant", "variant"), ("step", "step"), ("ratio", "vs memory"),
        ("peak", "device peak MiB"), ("share", "of in-memory peak"), ("hidden", "copy hidden"),
        ("plan", "plan")])


def traced(prefetch: bool, steps: int = 2, choices: list[str] | str = "swap",
           width: int = WIDTH, blocks: int = BLOCKS) -> tuple[Timeline, float]:
    """The last of `steps` offloaded steps (states on the host) on SE-MoE's compute and copy
    rows, and the share of its copy time hidden behind compute."""
    model = offload_model(width, blocks)
    x, y = batch(width=width)
    off = Offload(model, _adam, choices, states="host", prefetch=prefetch)
    for _ in range(steps - 1):
        mse(off(x), y).backward()
        off.step()
    with capture() as c:
        mse(off(x), y).backward()
        off.step()
    return timeline_rows(c.timeline), hidden_fraction(c.timeline)
