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
from .runtime import Cluster, Results, rank


@dataclass
class TourRow:
    """One line of the report."""

    technique: str
    ranks: int
    matches: bool
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


STEPS: list[Callable[[TourContext], TourRow | list[TourRow]]] = [
    step_hello, step_split_work, step_slow_worker, step_collectives]


def format_report(rows: list[TourRow]) -> str:
    shown = [{"technique": r.technique, "ranks": r.ranks,
              "matches": "yes" if r.matches else "NO",
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
    print(f"\n{sum(r.matches for r in rows)}/{len(rows)} techniques match one process. "
          f"Pictures, Chrome traces (open in Perfetto) and the report are in {out_dir}/")
    return rows
