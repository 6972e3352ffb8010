"""`minipar bench zero`: per-rank memory and step time of data parallelism and ZeRO
stages 1, 2 and 3 (and 3 with prefetch), measured beside ZeRO's formula and beside
torch's FSDP2."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import torch

from .. import cost
from ..data_parallel import DataParallel, shard
from ..models import mlp, mlp_parameters
from ..plots import stack_memory
from ..report import format_table, progress, save_results, spread
from ..runtime import Cluster, calm_from_birth, device, world_size
from .fsdp import FullyShardedDataParallel, default_units
from .memory_tracker import MemoryTracker, recompute
from .zero import ZeroDataParallel

ZERO_SIZES = [256, 1024, 1024, 1024, 256]  # about 2.4M parameters, float32
VARIANTS = ("data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 prefetch", "ZeRO-3 recompute",
            "torch FSDP2")
BATCH = 64
KINDS = ("parameters", "gradients", "optimizer")


def _stage(variant: str) -> int:
    return 0 if variant == "data parallel" else int(variant.split()[0][-1])


def _adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def _wrap(variant: str, model: torch.nn.Module, param_dtype: torch.dtype | None = None):
    """(callable model, step function, optimizer, ZeRO shards) for one variant."""
    if variant == "data parallel":
        opt = _adam(model.parameters())
        return DataParallel(model), opt.step, opt, []
    if variant == "torch FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with calm_from_birth():  # its groups' gloo threads as minipar's (runtime/gloo_threads.py)
            mesh = init_device_mesh("cpu", (world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _adam(model.parameters())
        return model, opt.step, opt, []
    stage = _stage(variant)
    if variant.endswith("recompute"):
        # a unit of one linear layer already keeps only its input: recomputation pays off
        # for units with activations inside, so pair the layers into two-layer blocks
        layers = list(model)
        model = torch.nn.Sequential(*(torch.nn.Sequential(*layers[i:i + 4])
                                      for i in range(0, len(layers), 4)))
        recompute(default_units(model))
    wrapped = FullyShardedDataParallel(model, _adam, param_dtype=param_dtype,
                                       prefetch=variant.endswith("prefetch")) if stage == 3 \
        else ZeroDataParallel(model, _adam, stage=stage, param_dtype=param_dtype)
    return wrapped, wrapped.step, wrapped.optimizer, wrapped.shards


def _run(variant: str, steps: int, sizes: list[int] = ZERO_SIZES,
         param_dtype: torch.dtype | None = None) -> dict:
    run, step, opt, shards = _wrap(variant, mlp(sizes, seed=0), param_dtype)
    tracker = MemoryTracker(getattr(run, "module", run), opt, shards)
    # a CPU generator draws on the host: moved just below
    x = torch.randn(BATCH, sizes[0], generator=torch.Generator().manual_seed(1))
    x = x.to(device())
    times, held = [], None
    for i in range(steps + 2):  # step 0 warms up, step 1 is measured for memory, the rest timed
        torch.distributed.barrier()
        start = time.perf_counter()
        with tracker.watch() if i == 1 else contextlib.nullcontext():
            ((run(shard(x)).float() - shard(x)) ** 2).mean().backward()
        if i == 1:
            if getattr(run, "comm", None) is not None:
                run.comm.join()  # prefetch: let the background reduce-scatters land first
            held = tracker.sample("after backward")
        step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    peak = tracker.peak()
    return {"seconds": statistics.median(times), **{k: getattr(held, k) for k in KINDS},
            "peak": peak.total, "peak_activations": max(s.activations for s in tracker.samples)}


def measure(world_sizes: tuple[int, ...] = (2, 4), steps: int = 5, rounds: int = 3
            ) -> list[dict]:
    """Each variant on K ranks: median step time (slowest rank; the variants take turns
    for `rounds` rounds, ratios per round), and rank 0's bytes by kind after backward
    (when parameters, gradients and optimizer state are all present)."""
    params = mlp_parameters(ZERO_SIZES)
    rows = []
    for k in world_sizes:
        formula = formula_memory(params, k, mixed=False)
        runs: dict[str, list] = {variant: [] for variant in VARIANTS}
        with Cluster(k, backend="gloo") as cluster:
            for round_index in range(rounds):
                for variant in VARIANTS:
                    progress(f"K={k}: {variant}, round {round_index + 1}/{rounds}")
                    runs[variant].append(cluster.run(_run, variant, steps))
        seconds = {v: [max(r["seconds"] for r in run) for run in runs[v]] for v in VARIANTS}
        for variant in VARIANTS:
            row = {"world_size": k, "variant": variant, "params": params,
                   **runs[variant][0][0], "seconds": statistics.median(seconds[variant]),
                   "vs_dp_rounds": [t / d for t, d in zip(seconds[variant],
                                                          seconds["data parallel"],
                                                          strict=True)],
                   "vs_fsdp2_rounds": [t / f for t, f in zip(seconds[variant],
                                                             seconds["torch FSDP2"],
                                                             strict=True)]}
            if variant != "torch FSDP2":
                row.update(_beside(formula[_stage(variant)]))
            rows.append(row)
    for row in rows:
        row["vs_dp"] = statistics.median(row["vs_dp_rounds"])
        row["vs_fsdp2"] = statistics.median(row["vs_fsdp2_rounds"])
    return rows


def _beside(formula_row: dict) -> dict:
    """A formula row's bytes by kind as `formula_<kind>` keys, to sit beside measured ones."""
    return {f"formula_{k}": formula_row[k] for k in KINDS}


def formula_memory(params: float, world_size: int, mixed: bool) -> list[dict]:
    """ZeRO's formula per stage (0 = data parallelism): bytes per rank by kind, for float32
    training or mixed precision (bf16 weights and gradients, float32 master and Adam)."""
    full = cost.training_memory(params, weights="bf16" if mixed else "fp32",
                                grads="bf16" if mixed else "fp32", optimizer="adam",
                                optimizer_dtype="fp32", master_weights="fp32" if mixed else None)
    rows = []
    for stage in range(4):
        m = cost.zero_memory(full, stage, world_size)
        rows.append({"stage": stage, "parameters": m.weights, "gradients": m.gradients,
                     "optimizer": m.optimizer})  # the kinds MemoryTracker measures
    return rows


def measure_memory(world_size: int = 4, mixed: bool = False,
                   sizes: list[int] | None = None) -> list[dict]:
    """Rank 0's bytes by kind after backward for ZeRO stages 1-3 (and data parallelism in
    float32) on `world_size` CPU ranks, each row beside the formula's (`formula_*` keys)."""
    sizes = sizes or [64, 256, 256, 64]
    formula = formula_memory(mlp_parameters(sizes), world_size, mixed)
    variants = (["data parallel"] if not mixed else []) + ["ZeRO-1", "ZeRO-2", "ZeRO-3"]
    rows = []
    with Cluster(world_size, backend="gloo") as cluster:
        for variant in variants:
            stage = _stage(variant)
            got = cluster.run(_run, variant, 1, sizes,
                              torch.bfloat16 if mixed else None)[0]
            rows.append({"stage": stage, **{k: got[k] for k in KINDS},
                         **_beside(formula[stage])})
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def report(rows: list[dict], out_dir: Path) -> str:
    """Measured MiB per kind beside the formula's, peak, step time vs DP and vs FSDP2."""
    from matplotlib.figure import Figure

    shown = []
    for r in rows:
        line = {"K": str(r["world_size"]), "variant": r["variant"],
                "step": f"{r['seconds'] * 1e3:.1f} ms",
                "vs DP": spread(r["vs_dp_rounds"]),
                "vs FSDP2": spread(r["vs_fsdp2_rounds"])}
        for kind in KINDS:
            want = r.get(f"formula_{kind}")
            line[kind] = "-" if want is None else f"{_mb(r[kind])} / {_mb(want)}"
        line["peak"] = "-" if r["variant"] == "torch FSDP2" else _mb(r["peak"])
        line["activations"] = "-" if r["variant"] == "torch FSDP2" else _mb(r["peak_activations"])
        shown.append(line)
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, len({r["world_size"] for r in rows}), squeeze=False)[0]
    for ax, k in zip(axes, sorted({r["world_size"] for r in rows}), strict=True):
        mine = [r for r in rows if r["world_size"] == k and r["variant"] != "torch FSDP2"]
        names = [r["variant"] for r in mine]
        stack_memory(ax, mine, names)
        ax.scatter(names, [sum(r[f"formula_{kind}"] for kind in KINDS) / 2**20 for r in mine],
                   marker="_", s=400, color="black", label="formula", zorder=3)
        ax.set_title(f"{k} ranks: MiB per rank after backward", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    save_results(rows, fig, out_dir, "zero",
                 title="ZeRO stages and FSDP: memory per rank by kind, measured vs formula")
    header = ("measured / formula MiB per rank after backward (rank 0); activ. peak and peak = "
              "largest activations and largest total sampled over the step; step = median, "
              "slowest rank; the trainers take turns, vs DP and vs FSDP2 = step time ratios "
              "per round, median (min-max)")
    return header + "\n" + format_table(shown, [
        ("K", "K"), ("variant", "trainer"), ("parameters", "parameters"),
        ("gradients", "gradients"), ("optimizer", "optimizer"), ("activations", "activ. peak"),
        ("peak", "peak MiB"),
        ("step", "step"), ("vs DP", "vs DP"), ("vs FSDP2", "vs FSDP2")])
