"""`minipar tour`: every technique on CPU ranks, checked against one process, in one report.

Each step runs a technique for real, compares its answer with a single-process
reference, times both, and may leave pictures and Chrome traces in the output
folder. Later capabilities append their steps to STEPS.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import basics
from .bench import format_table
from .runtime import Cluster, Results, rank, world_size


@dataclass
class TourRow:
    """One line of the report."""

    technique: str
    ranks: int
    matches: bool | None  # None: not exact by design (see note)
    seconds: float
    speedup: float | None = None  # one process's time / the parallel run's time
    bytes_moved: int | None = None  # metered traffic, where a meter exists
    note: str = ""


class TourContext:
    """What steps share: live clusters by size and the output folder."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._clusters: dict[int, Cluster] = {}

    def cluster(self, world_size: int) -> Cluster:
        if world_size not in self._clusters:
            self._clusters[world_size] = Cluster(world_size, backend="gloo")
        return self._clusters[world_size]

    def close(self) -> None:
        for cluster in self._clusters.values():
            cluster.close()


def one_process(fn: Callable[[], object], repeats: int = 3) -> tuple[object, float]:
    """Run the single-process reference on one thread, as one rank would; best time of a few."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - start)
        return result, best
    finally:
        torch.set_num_threads(threads)


def best_run(cluster: Cluster, fn: Callable, *args, repeats: int = 3, **kwargs) -> Results:
    """The fastest of a few runs (machine noise only ever adds time)."""
    runs = [cluster.run(fn, *args, **kwargs) for _ in range(repeats)]
    return min(runs, key=lambda r: r.seconds)


def step_hello(ctx: TourContext) -> TourRow:
    results = ctx.cluster(4).run(basics.hello)
    return TourRow("hello: all-reduce of rank+1 (torch, gloo)", 4, results == [10.0] * 4,
                   results.seconds, note="every rank holds 1+2+3+4")


def _share_of_work(tasks: int, units: int) -> float:
    import minipar

    me, size = minipar.rank(), minipar.world_size()
    local = torch.tensor([sum(basics.busy_work(units + t) for t in range(me, tasks, size))],
                         dtype=torch.float64)
    torch.distributed.all_reduce(local)
    return local.item()


def step_split_work(ctx: TourContext, tasks: int = 16, units: int = 200) -> TourRow:
    reference, single = one_process(lambda: sum(basics.busy_work(units + t)
                                                for t in range(tasks)))
    results = best_run(ctx.cluster(2), _share_of_work, tasks, units)
    matches = all(math.isclose(r, reference, rel_tol=1e-9) for r in results)
    return TourRow("independent work split over ranks + all-reduce", 2, matches,
                   results.seconds, single / results.seconds,
                   note="ceiling 2x on 2 cores")


def step_slow_worker(ctx: TourContext, steps: int = 3, units: int = 150) -> TourRow:
    from minipar.widgets import render_timeline, to_png

    cluster = ctx.cluster(4)
    balanced = best_run(cluster, basics.synchronized_steps, steps, units)
    slow = best_run(cluster, basics.synchronized_steps, steps, units, slow_rank=3, slowdown=2.0)
    per_rank = [units] * 3 + [2 * units]
    reference, single = one_process(
        lambda: [sum(basics.busy_work(u) for u in per_rank) for _ in range(steps)][-1])
    matches = all(math.isclose(r, reference, rel_tol=1e-6) for r in slow)
    summary = slow.timeline.summary()
    (ctx.out_dir / "slow_worker.png").write_bytes(
        to_png(render_timeline(slow.timeline, title="one slow rank (rank 3 does 2x work)")))
    slow.timeline.save_chrome(ctx.out_dir / "slow_worker.trace.json")
    return TourRow("one slow worker, then synchronize", 4, matches, slow.seconds,
                   single / slow.seconds,
                   note=f"{slow.seconds / balanced.seconds:.2f}x the balanced step time; "
                        f"idle {summary.bubble_fraction:.0%} of rank-time")


def _rank_data(numel: int) -> torch.Tensor:
    """This rank's tensor: random integers in float64, so every sum order is exact."""
    generator = torch.Generator().manual_seed(1000 + rank())
    return torch.randint(-1000, 1000, (numel,), generator=generator).to(torch.float64)


def _collective_run(algorithm: str, numel: int) -> tuple:
    """One all-reduce (minipar's `algorithm`, or torch's): result, bytes sent, seconds."""
    import torch.distributed as dist

    from . import collectives

    tensor = _rank_data(numel)
    dist.barrier()
    start = time.perf_counter()
    with collectives.meter() as m:
        if algorithm == "torch":
            dist.all_reduce(tensor)
        else:
            collectives.all_reduce(tensor, algorithm=algorithm)
    return tensor, m.sent_bytes, time.perf_counter() - start


def step_collectives(ctx: TourContext, numel: int = 1 << 19) -> list[TourRow]:
    from . import collectives

    cluster = ctx.cluster(4)
    reference = sum(cluster.run(_rank_data, numel))  # one process adds them up
    torch_seconds = min(max(r[2] for r in cluster.run(_collective_run, "torch", numel))
                        for _ in range(3))
    rows = []
    for algorithm in collectives.ALL_REDUCE_ALGORITHMS:
        runs = [cluster.run(_collective_run, algorithm, numel) for _ in range(3)]
        best = min(runs, key=lambda run: max(r[2] for r in run))
        seconds = max(r[2] for r in best)
        rows.append(TourRow(f"all-reduce, {algorithm} (minipar, 4 MiB)", 4,
                            all(torch.equal(r[0], reference) for r in best), seconds,
                            bytes_moved=sum(r[1] for r in best),
                            note=f"{torch_seconds / seconds:.2f}x torch's gloo all_reduce"))
    return rows


# --- data parallelism ---

DP_STEPS, DP_BATCH = 4, 64


def _dp_batches(steps: int = DP_STEPS, dtype: torch.dtype = torch.float64) -> list:
    from .models import regression_data

    x, y = regression_data(steps * DP_BATCH, 32, seed=7, dtype=dtype)
    return list(zip(x.split(DP_BATCH), y.split(DP_BATCH), strict=True))


def _dp_model(dtype: torch.dtype = torch.float64):
    from .models import mlp

    return mlp([32, 256, 256, 1], seed=7, dtype=dtype)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference_sgd(lr: float = 0.05) -> tuple[list[float], torch.Tensor]:
    from .data_parallel import single_process_sgd

    return single_process_sgd(_dp_model(), _dp_batches(), _mse, lr)


def _all_reduce_trainer(lr: float = 0.05) -> tuple:
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector

    from . import collectives
    from .data_parallel import DataParallel, shard, shard_weight

    model = _dp_model()
    ddp = DataParallel(model, bucket_bytes=64 << 10, overlap=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    start = time.perf_counter()
    with collectives.meter() as m:
        for x, y in _dp_batches():
            lx, ly = shard(x), shard(y)
            loss = _mse(ddp(lx), ly) * shard_weight(len(lx), len(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
    return losses, parameters_to_vector(model.parameters()).detach(), m.sent_bytes, \
        time.perf_counter() - start


def _ps_trainer(lr: float = 0.05) -> tuple:
    from . import collectives
    from .parameter_server import train_parameter_server

    start = time.perf_counter()
    with collectives.meter() as m:
        report = train_parameter_server(_dp_model(), _dp_batches(), _mse, lr)
    return report, m.sent_bytes, time.perf_counter() - start


def step_data_parallel(ctx: TourContext) -> list[TourRow]:
    from .compression import TopK, train_compressed
    from .relaxed import train_relaxed

    ref_losses, ref_params = _reference_sgd()
    rows = []
    runs = ctx.cluster(2).run(_all_reduce_trainer)
    exact = all(torch.allclose(p, ref_params, rtol=1e-9, atol=1e-12) for _, p, _, _ in runs) \
        and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(runs[0][0], ref_losses,
                                                                  strict=True))
    seconds = max(r[3] for r in runs)
    rows.append(TourRow("data parallel: bucketed all-reduce, overlapped", 2, exact, seconds,
                        None, sum(r[2] for r in runs),
                        note="every step, float64; speedups: minipar bench data-parallel"))
    ps = ctx.cluster(4).run(_ps_trainer)
    exact = torch.allclose(ps[0][0].params, ref_params, rtol=1e-9, atol=1e-12)
    seconds = max(r[2] for r in ps)
    rows.append(TourRow("parameter server, sync (1 server, 3 workers)", 4, exact, seconds,
                        None, sum(r[1] for r in ps),
                        note="server's weights vs single-process SGD"))
    local = ctx.cluster(2).run(train_relaxed, "local_sgd", _dp_model, _dp_batches(), _mse, 0.05,
                               local_steps=1)
    rows.append(TourRow("local SGD, H=1 (average every step)", 2,
                        all(torch.allclose(p, ref_params, rtol=1e-9, atol=1e-12)
                            for _, p in local), local.seconds,
                        note="H=1 is synchronous SGD"))
    long_batches = _dp_batches(24)
    for method, label, ranks in (("co2", "CO2-style local SGD, H=4, async average", 2),
                                 ("hogwild", "Hogwild!, lock-free shared memory", 2)):
        kwargs = {"shared_file": str(ctx.out_dir / "hogwild.bin")} if method == "hogwild" \
            else {"local_steps": 4}
        dtype = torch.float32 if method == "hogwild" else torch.float64
        run = ctx.cluster(ranks).run(train_relaxed, method, lambda d=dtype: _dp_model(d),
                                     _dp_batches(24, dtype), _mse, 0.05, **kwargs)
        first, last = run[0][0].losses[0], run[0][0].losses[-1]
        rows.append(TourRow(label, ranks, None, run.seconds,
                            note=f"not exact by design; loss {first:.3f} -> {last:.3f}"))
    compressed = ctx.cluster(2).run(train_compressed, _dp_model(), long_batches, _mse, 0.05,
                                    TopK(0.05))
    report = compressed[0]
    share = sum(report.payload_bytes) / (len(long_batches) * report.dense_bytes)
    rows.append(TourRow("data parallel, top-5% gradients + error feedback", 2, None,
                        compressed.seconds,
                        note=f"payload {share:.0%} of dense; "
                             f"loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}"))
    return rows


# --- pipelines ---

def _pipeline_layers(stages: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(stages):
        layers += [torch.nn.Linear(64, 64, dtype=torch.float64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _pipeline_batch() -> tuple[torch.Tensor, torch.Tensor]:
    from .models import regression_data

    return regression_data(64, 64, outputs=64, seed=9, dtype=torch.float64)


def _pipeline_run(name: str, microbatches: int, virtual: int) -> tuple:
    from .pipeline import Pipeline, schedule, split_model

    k = world_size()
    pipe = Pipeline(split_model(_pipeline_layers(k * virtual), k * virtual),
                    schedule(name, k, microbatches, virtual))
    x, y = _pipeline_batch()
    start = time.perf_counter()
    loss = pipe.train_step(x, y, _mse)
    seconds = time.perf_counter() - start
    return loss, {(s, i): p.grad for s, m in pipe.modules.items()
                  for i, p in enumerate(m.parameters())}, seconds


def step_pipeline(ctx: TourContext) -> list[TourRow]:
    from .pipeline import schedule, simulate, split_model

    rows = []
    for name, m, v, ranks in (("gpipe", 8, 1, 2), ("1f1b", 8, 1, 4), ("interleaved_1f1b", 8, 2, 2),
                              ("zb_h1", 8, 1, 2)):
        model = _pipeline_layers(ranks * v)
        x, y = _pipeline_batch()
        reference = _mse(model(x), y)
        reference.backward()
        stages = split_model(_pipeline_layers(ranks * v), ranks * v)
        where = [(s, i) for s, mod in enumerate(stages) for i, _ in enumerate(mod.parameters())]
        ctx.cluster(ranks).run(_pipeline_run, name, m, v)  # gloo connects p2p pairs lazily
        run = ctx.cluster(ranks).run(_pipeline_run, name, m, v)
        grads = {key: g for r in run for key, g in r[1].items()}
        loss = next(r[0] for r in run if r[0] is not None)
        exact = math.isclose(loss, reference.item(), rel_tol=1e-10) and all(
            torch.allclose(grads[key], p.grad, rtol=1e-9, atol=1e-12)
            for key, p in zip(where, model.parameters(), strict=True))
        plan = schedule(name, ranks, m, v)
        ideal = simulate(plan, {"F": 1, "B": 2, "I": 1, "W": 1}).summary(ranks).bubble_fraction
        timeline = run.timeline
        trace_name = f"pipeline_{name}.trace.json"
        timeline.save_chrome(ctx.out_dir / trace_name)
        moved = sum(e.bytes or 0 for e in timeline if e.kind == "send")
        rows.append(TourRow(f"pipeline {name} (m={m}{f', v={v}' if v > 1 else ''})", ranks,
                            exact, max(r[2] for r in run), bytes_moved=moved,
                            note=f"ideal bubble {ideal:.2f}; trace: {trace_name}"))
    return rows


# --- tensor parallelism ---

def _tp_block(kind: str, sequence_parallel: bool) -> tuple:
    from . import collectives
    from . import tensor_parallel as tp

    torch.manual_seed(0)
    twin = tp.MLP(64, 256, torch.float64) if kind == "mlp" else \
        tp.TransformerBlock(64, 4, 256, seed=0, dtype=torch.float64)
    x = torch.randn(16, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = twin(x)
    k, me = world_size(), rank()
    parallel = tp.ParallelMLP(twin, sequence_parallel=sequence_parallel) if kind == "mlp" \
        else tp.ParallelTransformerBlock(twin, sequence_parallel=sequence_parallel)
    local = x.chunk(k, 0)[me].contiguous() if sequence_parallel else x
    start = time.perf_counter()
    with collectives.meter() as m:
        out = parallel(local)
        out.sum().backward()
    want = reference.chunk(k, 0)[me] if sequence_parallel else reference
    return torch.allclose(out, want, rtol=1e-10), m.sent_bytes, time.perf_counter() - start


def step_tensor_parallel(ctx: TourContext) -> list[TourRow]:
    rows = []
    for kind, sp in (("mlp", False), ("block", False), ("block", True)):
        run = ctx.cluster(2).run(_tp_block, kind, sp)
        label = {"mlp": "Megatron MLP", "block": "transformer block"}[kind]
        rows.append(TourRow(f"tensor parallel: {label}{', sequence parallel' if sp else ''}",
                            2, all(r[0] for r in run), max(r[2] for r in run),
                            bytes_moved=sum(r[1] for r in run),
                            note="output vs the one-process twin; speedups: minipar bench "
                                 "tensor-parallel"))
    return rows


# --- mixture of experts ---

def _moe_twin():
    from .moe import MoELayer

    return MoELayer(16, 32, num_experts=4, k=2, capacity_factor=1.0, shared_expert=True,
                    seed=11, dtype=torch.float64)


def _moe_tokens(world: int) -> torch.Tensor:
    return torch.randn(8 * world, 16, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(12))


def _ep_forward() -> tuple:
    from . import collectives
    from .expert_parallel import ExpertParallelMoE

    layer = ExpertParallelMoE(_moe_twin())
    k, me = world_size(), rank()
    x = _moe_tokens(k)[me * 8:(me + 1) * 8]
    start = time.perf_counter()
    with collectives.meter() as m:
        y = layer(x)
    return y, m.sent_bytes, time.perf_counter() - start, layer.tokens_received


def step_experts(ctx: TourContext) -> list[TourRow]:
    rows = []
    for ranks in (2, 4):
        twin = _moe_twin()
        reference = twin(_moe_tokens(ranks))
        run = ctx.cluster(ranks).run(_ep_forward)
        exact = all(torch.allclose(y, reference[r * 8:(r + 1) * 8], rtol=1e-12)
                    for r, (y, _, _, _) in enumerate(run))
        received = [r[3] for r in run]
        rows.append(TourRow(f"expert parallel MoE (E=4, k=2, shared expert), EP={ranks}", ranks,
                            exact, max(r[2] for r in run), bytes_moved=sum(r[1] for r in run),
                            note=f"drops {twin.last_routing.drop_rate:.0%}; tokens received "
                                 f"per rank {received}"))
    return rows


STEPS: list[Callable[[TourContext], TourRow | list[TourRow]]] = [
    step_hello, step_split_work, step_slow_worker, step_collectives, step_data_parallel,
    step_pipeline, step_tensor_parallel, step_experts]


def format_report(rows: list[TourRow]) -> str:
    shown = [{"technique": r.technique, "ranks": r.ranks,
              "matches": {True: "yes", False: "NO", None: "-"}[r.matches],
              "time": f"{r.seconds * 1e3:.0f} ms",
              "speedup": "-" if r.speedup is None else f"{r.speedup:.2f}x",
              "bytes": "-" if r.bytes_moved is None else f"{r.bytes_moved:,}",
              "note": r.note} for r in rows]
    return format_table(shown, [("technique", "technique"), ("ranks", "ranks"),
                                ("matches", "matches one process?"), ("time", "time"),
                                ("speedup", "speedup"), ("bytes", "bytes moved"),
                                ("note", "note")])


def run_tour(out_dir: str | Path = "minipar-out") -> list[TourRow]:
    """Run every step, print the report, and write report.json/.txt, pictures and traces."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = TourContext(out_dir)
    rows = []
    try:
        for step in STEPS:
            print(f"  .. {step.__name__.removeprefix('step_')}", flush=True)
            produced = step(ctx)
            rows.extend(produced if isinstance(produced, list) else [produced])
    finally:
        ctx.close()
    report = format_report(rows)
    print(report)
    (out_dir / "report.txt").write_text(report + "\n")
    (out_dir / "report.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    exact = [r for r in rows if r.matches is not None]
    print(f"\n{sum(r.matches for r in exact)}/{len(exact)} exact techniques match one process "
          f"({len(rows) - len(exact)} more are approximate by design). "
          f"Pictures, Chrome traces (open in Perfetto) and the report are in {out_dir}/")
    return rows
