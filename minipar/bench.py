"""Measurements that print a table, write JSON and a plot: `minipar bench NAME`.

Each benchmark compares things measured in the same run and reports medians; times
on a shared 2-core machine move by 10-30% from run to run, so read ratios, not digits.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import trace
from .runtime import Cluster, launch


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _nothing() -> None:
    return None


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table of `rows` with (key, header) columns."""
    cells = [[header for _, header in columns]]
    cells += [[str(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _save(rows: list[dict], fig, out_dir: Path, name: str) -> None:
    """Write a benchmark's rows as JSON and its figure as PNG into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"bench_{name}.json").write_text(json.dumps(rows, indent=2))
    fig.savefig(out_dir / f"bench_{name}.png", dpi=100)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def record_overhead(events: int = 200_000) -> tuple[float, float]:
    """Seconds per recorded event, with recording on and switched off."""
    def loop() -> None:
        for _ in range(events):
            with trace.record("compute", "x"):
                pass

    def empty() -> None:
        for _ in range(events):
            pass

    base = min(_timed(empty) for _ in range(3))
    with trace.capture():
        on = min(_timed(loop) for _ in range(3))
        previous = trace.set_recording(False)
        off = min(_timed(loop) for _ in range(3))
        trace.set_recording(previous)
    return (on - base) / events, (off - base) / events


def bench_launch(world_size: int = 4, cold_repeats: int = 3, warm_repeats: int = 50) -> list[dict]:
    """Cold launch (forkserver vs spawn), warm Cluster.run and per-event recording cost."""
    rows = []
    for method, fresh in (("forkserver", True), ("forkserver", False), ("spawn", False)):
        times = []
        for i in range(cold_repeats):
            _progress(f"launch with {method}{', fresh Python' if fresh else ''}, "
                      f"{i + 1}/{cold_repeats}")
            times.append(_fresh_launch(world_size) if fresh
                         else _timed(lambda m=method: _cold(world_size, m)))
        what = ("first launch in a fresh Python" if fresh else
                "next launch, server running" if method == "forkserver" else "launch")
        rows.append({"measure": f"{what}, {world_size} ranks ({method})",
                     "median": statistics.median(times), "unit": "s",
                     "goal": 4.0 if method == "forkserver" else None})
    _progress(f"warm Cluster.run x{warm_repeats}")
    with Cluster(world_size, backend="gloo") as cluster:
        for _ in range(5):
            cluster.run(_nothing)
        warm = [_timed(lambda: cluster.run(_nothing)) for _ in range(warm_repeats)]
    rows.append({"measure": f"warm Cluster.run, {world_size} ranks", "median":
                 statistics.median(warm), "unit": "s", "goal": 0.020})
    on, off = record_overhead()
    rows.append({"measure": "record() per event, recording on", "median": on, "unit": "s",
                 "goal": 2e-6})
    rows.append({"measure": "record() per event, recording off", "median": off, "unit": "s",
                 "goal": None})
    for row in rows:
        row["meets_goal"] = None if row["goal"] is None else row["median"] <= row["goal"]
    return rows


def _fresh_launch(world_size: int) -> float:
    """Seconds for launch() in a new interpreter (minipar imported, no server yet)."""
    code = ("import time, minipar\n"
            "from minipar.bench import _nothing\n"
            "t = time.perf_counter()\n"
            f"minipar.launch(_nothing, {world_size}, backend='gloo')\n"
            "print(time.perf_counter() - t)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _cold(world_size: int, method: str) -> None:
    if method == "forkserver":
        launch(_nothing, world_size, backend="gloo")
    else:
        with Cluster(world_size, backend="gloo", start_method=method) as cluster:
            cluster.run(_nothing)


def _human(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.2f} us"


def launch_report(rows: list[dict], out_dir: Path) -> str:
    """Print-ready table; writes bench_launch.json and bench_launch.png into out_dir."""
    from matplotlib.figure import Figure

    shown = [{"measure": r["measure"], "median": _human(r["median"]),
              "goal": "" if r["goal"] is None else "<= " + _human(r["goal"]),
              "ok": {None: "", True: "yes", False: "NO"}[r["meets_goal"]]} for r in rows]
    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.add_subplot()
    goals = [r for r in rows if r["goal"]]
    ax.barh([r["measure"] for r in goals], [r["median"] / r["goal"] for r in goals],
            color=["#55A868" if r["meets_goal"] else "#C44E52" for r in goals])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("measured / goal (left of the line meets the goal)")
    _save(rows, fig, out_dir, "launch")
    return format_table(shown, [("measure", "measure"), ("median", "median"),
                                ("goal", "goal"), ("ok", "meets goal")])


# --- collectives: minipar's algorithms vs torch's built-in, and vs the alpha-beta model ---

COLLECTIVE_SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB ... 64 MiB
PINGPONG_SIZES = [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _time_round_robin(algorithms: list[str], nbytes: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per all-reduce on this rank, the algorithms taking turns each round, so all
    see the same machine conditions (validation and tracing off, one warm-up each)."""
    import torch
    import torch.distributed as dist

    from . import collectives

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


def _reduce_seconds_per_byte(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """gamma: seconds per byte for an in-place add, on one thread."""
    import torch

    a, b = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)
    return best / nbytes


def _pingpong(sizes: list[int], repeats: int = 5) -> list[float]:
    """One-way seconds for each message size between ranks 0 and 1 (half a round trip)."""
    import torch
    import torch.distributed as dist

    from .runtime import rank

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


def bench_collectives(world_sizes: tuple[int, ...] = (2, 4),
                      sizes: list[int] | None = None) -> list[dict]:
    """All-reduce time and bus bandwidth per algorithm, size and K, with torch's for scale.

    Per (K, size) the algorithms take turns for several rounds; a rank-round's time is
    the slowest rank's; rows report medians, and ring vs torch as the median of the
    per-round ratios with their spread (the machine's noise, measured).
    """
    from . import collectives
    from .cost import all_reduce_cost, fit_alpha_beta

    sizes = sizes or COLLECTIVE_SIZES
    algorithms = ["torch", *collectives.ALL_REDUCE_ALGORITHMS]
    rows = []
    for k in world_sizes:
        with Cluster(k, backend="gloo") as cluster:
            _progress(f"K={k}: fitting alpha, beta (ping-pong) and gamma (additions)")
            one_way = cluster.run(_pingpong, PINGPONG_SIZES)[0]
            alpha, beta = fit_alpha_beta(PINGPONG_SIZES, one_way)
            gamma = cluster.run(_reduce_seconds_per_byte)[0]
            for nbytes in sizes:
                rounds = 15 if nbytes <= 1 << 20 else 7 if nbytes <= 16 << 20 else 5
                _progress(f"K={k}, {_size(nbytes)}: {rounds} rounds of {', '.join(algorithms)}")
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


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def collectives_report(rows: list[dict], out_dir: Path) -> str:
    """Bus bandwidth per algorithm (GB/s), ring vs torch, ring vs model; JSON and a plot."""
    from matplotlib.figure import Figure

    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    world_sizes = sorted({r["world_size"] for r in rows})
    by_key = {(r["world_size"], r["bytes"], r["algorithm"]): r for r in rows}
    table = []
    for k in world_sizes:
        for nbytes in sorted({r["bytes"] for r in rows if r["world_size"] == k}):
            line = {"K": k, "size": _size(nbytes)}
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
    _save(rows, fig, out_dir, "collectives")
    alpha, beta, gamma = rows[0]["alpha"], rows[0]["beta"], rows[0]["gamma"]
    columns = [("K", "K"), ("size", "size")] + [(a, a) for a in algorithms] + [
        ("ring/torch", "ring vs torch (range)"), ("ring/model", "ring time / model")]
    return (f"bus bandwidth in GB/s = size/time x 2(K-1)/K (higher is better); K={world_sizes[0]}: "
            f"alpha = {alpha * 1e6:.0f} us, 1/beta = {1 / beta / 1e9:.2f} GB/s (ping-pong), "
            f"1/gamma = {1 / gamma / 1e9:.1f} GB/s (additions)\n"
            "ring vs torch: median of per-round time ratios (min-max over rounds)\n"
            + format_table(table, columns))


# --- data parallelism: minipar's trainers vs one process and vs torch's DDP ---

DP_SIZES = {  # name: (layer sizes, samples per rank): compute-bound vs communication-bound
    "compute-bound": ([256, 512, 512, 256], 512),
    "communication-bound": ([1024, 1536, 1536, 1024], 8),
}
DP_VARIANTS = ("one process", "per-parameter", "bucketed", "bucketed+overlap", "torch DDP")
DDP_BUCKET_BYTES = 25 << 20  # torch DDP's default bucket_cap_mb, for a like-for-like comparison


def _dp_throughput(variant: str, sizes: list[int], per_rank: int, steps: int) -> dict:
    """Samples/s of one variant (one process runs the whole K x per_rank batch itself)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from .data_parallel import DataParallel
    from .models import mlp
    from .runtime import world_size

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


def bench_data_parallel(world_size: int = 2, steps: int = 8, rounds: int = 3) -> list[dict]:
    """Samples/s for one process and K ranks under each trainer, at two model sizes.

    The variants take turns for `rounds` rounds and each keeps its best round (noise
    on a shared machine only ever adds time); a round's time is its slowest rank's.
    """
    rows = []
    with Cluster(world_size, backend="gloo") as cluster:
        for name, (sizes, per_rank) in DP_SIZES.items():
            params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
            best: dict[str, dict] = {}
            for round_index in range(rounds):
                for variant in DP_VARIANTS:
                    _progress(f"{name}: {variant}, round {round_index + 1}/{rounds}")
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


def data_parallel_report(rows: list[dict], out_dir: Path) -> str:
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
    _save(rows, fig, out_dir, "data_parallel")
    return format_table(shown, [("size", "model"), ("variant", "trainer"),
                                ("samples/s", "samples/s"), ("speedup", "vs one process"),
                                ("vs DDP", "vs torch DDP"), ("comm", "all-reduce share")])


# --- the speedup lab: weak scaling of one data-parallel configuration ---

COMPRESSION_CHOICES = ("none", "top-1%", "top-10%", "int8", "powersgd-4")


def _make_compressor(name: str):
    from .compression import Int8, PowerSGD, TopK

    choices = {"top-1%": lambda: TopK(0.01), "top-10%": lambda: TopK(0.1), "int8": Int8,
               "powersgd-4": lambda: PowerSGD(4)}
    if name not in choices:
        raise ValueError(f"compression must be one of {COMPRESSION_CHOICES}; got {name!r}")
    return choices[name]()


def _lab_steps(width: int, per_rank: int, bucket_bytes: int | None, compression: str,
               steps: int) -> float:
    """Median step time on this rank; compute and all-reduce spans go into the Timeline."""
    import torch

    from .compression import ErrorFeedback
    from .data_parallel import DataParallel
    from .models import mlp
    from .runtime import world_size

    model = mlp([width, width, width, width], seed=0)
    x = torch.randn(per_rank, width)
    parallel = world_size() > 1
    wrapped = DataParallel(model, bucket_bytes, overlap=True) \
        if parallel and compression == "none" else model
    compressor = _make_compressor(compression) if parallel and compression != "none" else None
    feedback = ErrorFeedback()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        with trace.record("compute", "forward+backward", step=step):
            ((wrapped(x) - x) ** 2).mean().backward()
        if compressor is not None:
            with trace.record("all_reduce", "compressed gradients", step=step), torch.no_grad():
                for name, p in model.named_parameters():
                    p.grad.copy_(feedback.average(compressor, p.grad, name))
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_speedup(max_ranks: int, width: int, per_rank: int, bucket_bytes: int | None,
                    compression: str = "none", steps: int = 5) -> list[dict]:
    """Weak scaling (per-rank batch fixed) on 1..max_ranks ranks, measured and modelled.

    Speedup = samples/s on K ranks over samples/s on 1. The model: the 1-rank step
    time (all compute) plus an alpha-beta-gamma ring all-reduce of the gradient as
    sent (compressed size), with alpha, beta, gamma measured on this machine.
    """
    from .cost import fit_alpha_beta

    if compression != "none":
        _make_compressor(compression)
    rows = []
    alpha = beta = gamma = 0.0
    for k in range(1, max_ranks + 1):
        with Cluster(k, backend="gloo") as cluster:
            if k == 2:
                one_way = cluster.run(_pingpong, PINGPONG_SIZES[:5])[0]
                alpha, beta = fit_alpha_beta(PINGPONG_SIZES[:5], one_way)
                gamma = cluster.run(_reduce_seconds_per_byte)[0]
            result = cluster.run(_lab_steps, width, per_rank, bucket_bytes, compression, steps)
        measured = [e for e in result.timeline if (e.step or 0) >= 1 or e.kind != "compute"]
        first = min(e.start for e in result.timeline if e.label == "forward+backward"
                    and e.step == 1)
        summary = trace.Timeline(e for e in measured if e.start >= first).summary(k)
        rows.append({"ranks": k, "seconds": max(result),
                     "samples_per_s": k * per_rank / max(result),
                     "compute": sum(summary.busy) / k / steps,
                     "comm": sum(summary.comm) / k / steps,
                     "idle": sum(summary.idle) / k / steps})
    base = rows[0]
    for row in rows:
        k = row["ranks"]
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        comm = _gradient_exchange_seconds(width, compression, k, alpha, beta, gamma)
        row["model_speedup"] = k * base["seconds"] / (base["seconds"] + comm)
    return rows


def _gradient_exchange_seconds(width: int, compression: str, k: int, alpha: float, beta: float,
                               gamma: float) -> float:
    """Modelled time to exchange one step's gradients of the lab's 3-layer MLP.

    Dense and PowerSGD factors are all-reduced (ring); top-k and int8 payloads are
    all-gathered (ring: K-1 steps, each rank forwarding one payload per step).
    """
    import torch

    from .cost import all_reduce_cost

    shapes = [(width, width), (width,)] * 3
    if compression == "none":
        return all_reduce_cost("ring", k, sum(math.prod(s) for s in shapes) * 4, alpha, beta,
                               gamma).seconds
    compressor = _make_compressor(compression)
    total = 0.0
    for shape in shapes:
        payload = compressor.payload_bytes(torch.empty(shape))
        if compression.startswith("powersgd") and len(shape) == 2:
            total += 2 * all_reduce_cost("ring", k, payload / 2, alpha, beta, gamma).seconds
        elif compression.startswith("powersgd"):
            total += all_reduce_cost("ring", k, payload, alpha, beta, gamma).seconds
        else:
            total += (k - 1) * (2 * alpha + payload * beta)  # two all-gathers: data + index/scale
    return total


# --- pipelines: speedup over one process, measured bubble vs the simulator's ---

def _pipeline_model(stages: int, width: int, layers_per_stage: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                     torch.nn.Tanh())
                                 for _ in range(stages * layers_per_stage)])


def _pipeline_steps(name: str, microbatches: int, virtual: int, width: int, batch: int,
                    layers_per_stage: int, steps: int) -> float:
    """Median seconds per training step of this schedule on this rank (Timeline recorded)."""
    import torch

    from .pipeline import Pipeline, schedule, split_model
    from .runtime import world_size

    k = world_size()
    model = _pipeline_model(k * virtual, width, layers_per_stage)
    pipe = Pipeline(split_model(model, k * virtual), schedule(name, k, microbatches, virtual))
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    times = []
    for step in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y, lambda out, t: ((out - t) ** 2).mean())
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _one_process_pipeline_model(stages: int, width: int, batch: int, layers_per_stage: int,
                                steps: int) -> float:
    import torch

    torch.set_num_threads(1)
    model = _pipeline_model(stages, width, layers_per_stage)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        ((model(x) - y) ** 2).mean().backward()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_vs_ideal(timeline: trace.Timeline, plan) -> dict:
    """Bubble of a real run's Timeline beside the simulator's for the same schedule fed the
    run's own median F / B (/ I / W) costs."""
    from .pipeline import simulate

    last_step = max((e.step or 0) for e in timeline) if timeline.events else 0
    costs = {}
    for kind in ("F", "B", "I", "W"):
        durations = [e.duration for e in timeline if e.kind == kind]
        if durations:
            costs[kind] = statistics.median(durations)
    ideal = simulate(plan, costs).summary(plan.ranks).bubble_fraction
    measured = timeline.summary(plan.ranks).bubble_fraction
    return {"measured": measured, "ideal": ideal, "costs": costs, "steps": last_step}


def _activation_peak(name: str, microbatches: int, width: int, batch: int,
                     layers_per_stage: int) -> int:
    """Peak bytes autograd kept for backward on this rank during one step of the schedule."""
    import torch

    from .pipeline import Pipeline, schedule, split_model
    from .runtime import world_size

    k = world_size()
    pipe = Pipeline(split_model(_pipeline_model(k, width, layers_per_stage), k),
                    schedule(name, k, microbatches))
    x = torch.randn(batch, width)
    pipe.train_step(x, x, lambda out, t: ((out - t) ** 2).mean())
    return pipe.activations.peak


def bench_pipeline(microbatches: tuple[int, ...] = (1, 2, 4, 8, 16), width: int = 512,
                   batch: int = 2048, layers_per_stage: int = 4, steps: int = 2) -> list[dict]:
    """Two pipeline stages vs one process running both, for each micro-batch count; and,
    at the largest count, the activation memory each rank really held (GPipe vs 1F1B).

    The batch is large enough (2048 rows) that even 16 micro-batches keep matrix
    products efficient; with small micro-batches per-op overhead eats the gain.
    """
    from .pipeline import peak_in_flight, schedule

    rows = []
    _progress("one process running both stages")
    single = min(_one_process_pipeline_model(2, width, batch, layers_per_stage, steps)
                 for _ in range(2))
    with Cluster(2, backend="gloo") as cluster:
        for name in ("gpipe", "1f1b"):
            for m in microbatches:
                _progress(f"{name}, m={m}")
                best = None
                for _ in range(2):
                    run = cluster.run(_pipeline_steps, name, m, 1, width, batch,
                                      layers_per_stage, steps)
                    if best is None or max(run) < max(best):
                        best = run
                seconds = max(best)
                last = trace.Timeline(e for e in best.timeline if e.kind in ("F", "B"))
                # keep the final (measured, not warm-up) step: events after the last barrier
                cut = sorted(e.start for e in last if e.label == "0F0")[-1]
                compared = measured_vs_ideal(trace.Timeline(e for e in best.timeline
                                                            if e.start >= cut),
                                             schedule(name, 2, m))
                rows.append({"schedule": name, "microbatches": m, "seconds": seconds,
                             "speedup": single / seconds, "ceiling": 2 * m / (m + 1),
                             "bubble_measured": compared["measured"],
                             "bubble_ideal": compared["ideal"],
                             "bubble_formula": 1 / (m + 1)})
        m = max(microbatches)
        _progress(f"activation memory, m={m}")
        for name in ("gpipe", "1f1b"):
            peaks = cluster.run(_activation_peak, name, m, width, batch, layers_per_stage)
            for row in rows:
                if row["schedule"] == name and row["microbatches"] == m:
                    row["activation_peak_bytes"] = list(peaks)
                    row["in_flight"] = peak_in_flight(schedule(name, 2, m))
    return rows


def pipeline_report(rows: list[dict], out_dir: Path) -> str:
    """Speedup and bubble per micro-batch count; JSON and a plot against 2m/(m+1)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ms = sorted({r["microbatches"] for r in rows})
    ax.plot(ms, [2 * m / (m + 1) for m in ms], color="black", linestyle="--",
            label="ceiling 2m/(m+1)")
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == name]
        ax.plot([r["microbatches"] for r in mine], [r["speedup"] for r in mine], marker="o",
                label=f"{name}, measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("speedup over one process")
    ax.set_title("2 pipeline stages on 2 CPU ranks", fontsize=10)
    ax.legend(fontsize=8)
    _save(rows, fig, out_dir, "pipeline")
    shown = [{"schedule": r["schedule"], "m": r["microbatches"],
              "speedup": f"{r['speedup']:.2f}x", "ceiling": f"{r['ceiling']:.2f}x",
              "measured": f"{r['bubble_measured']:.3f}", "ideal": f"{r['bubble_ideal']:.3f}",
              "formula": f"{r['bubble_formula']:.3f}"} for r in rows]
    memory = [r for r in rows if "activation_peak_bytes" in r]
    lines = []
    if len(memory) == 2:
        gpipe, one_f = memory
        for rank in range(2):
            measured = gpipe["activation_peak_bytes"][rank] / one_f["activation_peak_bytes"][rank]
            counted = gpipe["in_flight"][rank] / one_f["in_flight"][rank]
            lines.append(f"  rank {rank}: GPipe {gpipe['activation_peak_bytes'][rank] / 2**20:.1f}"
                         f" MiB, 1F1B {one_f['activation_peak_bytes'][rank] / 2**20:.1f} MiB: "
                         f"{measured:.2f}x measured, {counted:.2f}x by the simulator's counts "
                         f"({gpipe['in_flight'][rank]} vs {one_f['in_flight'][rank]} "
                         "micro-batches)")
    return ("bubble: measured from the run's Timeline; ideal = the simulator fed the run's own "
            "median F and B times; formula = (p-1)/(m+p-1)\n"
            + format_table(shown, [("schedule", "schedule"), ("m", "m"),
                                   ("speedup", "speedup"), ("ceiling", "ceiling 2m/(m+1)"),
                                   ("measured", "bubble measured"), ("ideal", "simulated"),
                                   ("formula", "formula")])
            + (f"\npeak activation memory at m={memory[0]['microbatches']} (autograd's saved "
               "tensors):\n" + "\n".join(lines) if lines else ""))


# --- tensor parallelism: one block split over 2 ranks vs the whole block on one ---

TP_HIDDEN = (256, 512, 1024, 1536)


def _tp_step_seconds(kind: str, hidden: int, tokens: int, steps: int) -> float:
    """Median forward+backward seconds of one block (parallel if world_size > 1)."""
    import torch

    from . import tensor_parallel as tp
    from .runtime import world_size

    torch.manual_seed(0)
    if kind == "mlp":
        twin = tp.MLP(hidden, 4 * hidden)
        block = tp.ParallelMLP(twin) if world_size() > 1 else twin
    else:
        twin = tp.TransformerBlock(hidden, hidden // 64, 4 * hidden)
        block = tp.ParallelTransformerBlock(twin) if world_size() > 1 else twin
    x = torch.randn(tokens // 4, 4, hidden)
    times = []
    for step in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        with trace.record("compute", f"{kind} step", step=step):
            block(x).sum().backward()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_tensor_parallel(hidden_sizes: tuple[int, ...] = TP_HIDDEN, tokens: int = 256,
                          steps: int = 3) -> list[dict]:
    """TP = 2 vs one process for the MLP and the transformer block at several hidden sizes."""
    rows = []
    with Cluster(1, backend="gloo") as one, Cluster(2, backend="gloo") as two:
        for kind in ("mlp", "block"):
            for hidden in hidden_sizes:
                _progress(f"{kind}, hidden {hidden}")
                single = min(one.run(_tp_step_seconds, kind, hidden, tokens, steps)[0]
                             for _ in range(2))
                parallel = min(max(two.run(_tp_step_seconds, kind, hidden, tokens, steps))
                               for _ in range(2))
                rows.append({"block": kind, "hidden": hidden, "tokens": tokens,
                             "one_process_s": single, "tp2_s": parallel,
                             "speedup": single / parallel})
    return rows


def tensor_parallel_report(rows: list[dict], out_dir: Path) -> str:
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
    _save(rows, fig, out_dir, "tensor_parallel")
    shown = [{"block": r["block"], "hidden": r["hidden"],
              "one": f"{r['one_process_s'] * 1e3:.1f} ms", "tp2": f"{r['tp2_s'] * 1e3:.1f} ms",
              "speedup": f"{r['speedup']:.2f}x"} for r in rows]
    return format_table(shown, [("block", "block"), ("hidden", "hidden"), ("one", "one process"),
                                ("tp2", "TP=2"), ("speedup", "speedup")])


# --- mixture of experts: MoE vs a dense FFN of equal active size, and EP = 2 ---

def _moe_step(kind: str, tokens: int, hidden: int, ffn: int, experts: int, k: int,
              steps: int) -> tuple[float, float]:
    """Median seconds per forward+backward, and the share spent in all-to-all (EP only)."""
    import torch

    from .expert_parallel import ExpertParallelMoE
    from .moe import Expert, MoELayer
    from .runtime import rank, world_size

    torch.manual_seed(0)
    if kind == "dense":
        layer = Expert(hidden, k * ffn)  # the same active parameters as k experts
    else:
        layer = MoELayer(hidden, ffn, experts, k, capacity_factor=1.25)
        if world_size() > 1:
            layer = ExpertParallelMoE(layer)
    local = tokens // world_size()
    x = torch.randn(tokens, hidden)[rank() * local:(rank() + 1) * local]
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


def bench_moe(tokens: int = 4096, hidden: int = 256, ffn: int = 512, experts: int = 8,
              k: int = 2, steps: int = 3) -> list[dict]:
    """Tokens/s: dense FFN (same active size), MoE on one process, MoE with EP = 2."""
    rows = []
    with Cluster(1, backend="gloo") as one, Cluster(2, backend="gloo") as two:
        for kind, cluster in (("dense", one), ("moe", one), ("moe, EP=2", two)):
            _progress(kind)
            best = min((cluster.run(_moe_step, kind.split(",")[0], tokens, hidden, ffn,
                                    experts, k, steps) for _ in range(2)),
                       key=lambda run: max(r[0] for r in run))
            seconds = max(r[0] for r in best)
            rows.append({"layer": kind, "tokens_per_s": tokens / seconds, "seconds": seconds,
                         "all_to_all_share": max(r[1] for r in best) if "EP" in kind else None})
    dense = rows[0]["tokens_per_s"]
    moe_one = rows[1]["tokens_per_s"]
    for row in rows:
        row["vs_dense"] = row["tokens_per_s"] / dense
        row["vs_one_process_moe"] = row["tokens_per_s"] / moe_one
    return rows


def moe_report(rows: list[dict], out_dir: Path) -> str:
    """Tokens/s table; JSON and a bar plot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3), layout="constrained")
    ax = fig.add_subplot()
    ax.bar([r["layer"] for r in rows], [r["tokens_per_s"] for r in rows],
           color=["#8C8C8C", "#4C72B0", "#55A868"])
    ax.set_ylabel("tokens / s (forward + backward)")
    _save(rows, fig, out_dir, "moe")
    shown = [{"layer": r["layer"], "tps": f"{r['tokens_per_s']:.0f}",
              "dense": f"{r['vs_dense']:.2f}x", "one": f"{r['vs_one_process_moe']:.2f}x",
              "a2a": "" if r["all_to_all_share"] is None else f"{r['all_to_all_share']:.0%}"}
             for r in rows]
    return format_table(shown, [("layer", "layer"), ("tps", "tokens/s"),
                                ("dense", "vs dense FFN"), ("one", "vs MoE on one process"),
                                ("a2a", "all-to-all share")])


BENCHMARKS = {"launch": (bench_launch, launch_report),
              "collectives": (bench_collectives, collectives_report),
              "data-parallel": (bench_data_parallel, data_parallel_report),
              "pipeline": (bench_pipeline, pipeline_report),
              "tensor-parallel": (bench_tensor_parallel, tensor_parallel_report),
              "moe": (bench_moe, moe_report)}


def run_benchmark(name: str, out_dir: str | Path = "bench-out") -> list[dict]:
    """Run benchmark `name`, print its table and write its JSON and plot into `out_dir`."""
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark must be one of {', '.join(sorted(BENCHMARKS))}; "
                         f"got {name!r}")
    measure, report = BENCHMARKS[name]
    rows = measure()
    print(report(rows, Path(out_dir)))
    print(f"(JSON and plot in {out_dir}/; medians on this machine, expect 10-30% run-to-run "
          "noise)")
    return rows
