"""One demo per technique, run three ways: `python -m minipar.<technique>`, `minipar tour`
and the tests.

A technique's `demo.py` has a rank-side function that runs the technique, checks it
against a single-process reference computed on the same rank, and returns one
`Check` per case (name, matches one process, seconds, bytes sent). `run_demo` runs
it on spawned ranks or under torchrun and prints the table; the tour runs it on a
shared `Context` and turns the checks into `Row`s, with whatever else the tour
adds (speedups, pictures, traces).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .cli import OneLineParser, nonnegative_int, positive_int, run_command
from .report import format_table
from .runtime import BACKENDS, Cluster, Results, launch, rank, under_torchrun


@dataclass
class Check:
    """What one rank says about one demo case."""

    technique: str
    matches: bool | None  # None: nothing to compare on this rank, or not exact by design
    seconds: float
    bytes_sent: int | None = None  # metered traffic, where a meter exists
    note: str = ""


@dataclass
class Row:
    """One line of a report: a case over all ranks."""

    technique: str
    ranks: int
    matches: bool | None
    seconds: float
    speedup: float | None = None  # one process's time / the parallel run's time
    bytes_moved: int | None = None  # all ranks' sent bytes added up
    note: str = ""


def combine(results: list[list[Check]]) -> list[Row]:
    """Per case: matches on every rank that checked something (None if no rank did: not
    exact by design), the slowest rank's time, all ranks' bytes."""
    rows = []
    for checks in zip(*results, strict=True):
        first = checks[0]
        sent = [c.bytes_sent for c in checks if c.bytes_sent is not None]
        judged = [c.matches for c in checks if c.matches is not None]
        matches = all(judged) if judged else None  # a rank may hold nothing to compare
        rows.append(Row(first.technique, len(checks), matches, max(c.seconds for c in checks),
                        bytes_moved=sum(sent) if sent else None, note=first.note))
    return rows


def format_rows(rows: list[Row]) -> str:
    """The report table every demo and the tour print."""
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


class Context:
    """What tour steps share: live clusters by size and the output folder."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._clusters: dict[int, Cluster] = {}

    def cluster(self, world_size: int) -> Cluster:
        if world_size not in self._clusters:
            self._clusters[world_size] = Cluster(world_size, backend="gloo")
        return self._clusters[world_size]

    def checks(self, world_size: int, fn: Callable[..., list[Check]], *args,
               **kwargs) -> list[Row]:
        """Run a rank-side demo on `world_size` ranks and combine its checks into rows."""
        return combine(self.cluster(world_size).run(fn, *args, **kwargs))

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


def demo_parser(description: str, default_ranks: int = 2, prog: str | None = None
                ) -> argparse.ArgumentParser:
    """The options every `python -m minipar.<technique>` demo shares: --ranks (torchrun's
    WORLD_SIZE when set) and --backend. Modules add their own before parsing; mistakes
    are one line (see `minipar.cli`)."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("--ranks", type=positive_int,
                        default=int(os.environ.get("WORLD_SIZE", default_ranks)),
                        help=f"how many ranks to spawn (default {default_ranks}; under "
                             "torchrun, its world size)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto: nccl with one GPU per rank, else gloo (CPU processes)")
    return parser


def run_demo(demo: Callable[..., list[Check]], description: str, default_ranks: int = 2,
             argv: list[str] | None = None, options: dict[str, int] | None = None,
             check_options: Callable[..., None] | None = None) -> list[Row]:
    """Parse --ranks, --backend and the demo's own integer `options` (name: default), run
    `demo(**options)` on every rank (spawned, or the ranks torchrun started), and print
    the table on rank 0. `check_options(ranks, **options)` may raise ValueError before
    any rank starts; its message, like any ValueError of the launch (a backend this
    machine lacks), becomes a one-line error, and Ctrl-C a one-line "interrupted"."""
    prog = "python -m " + demo.__module__.rsplit(".", 1)[0]
    parser = demo_parser(description, default_ranks, prog)
    for name, default in (options or {}).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=nonnegative_int, default=default,
                            help=f"default {default}")
    args = vars(parser.parse_args(argv))
    ranks, backend = args.pop("ranks"), args.pop("backend")
    if check_options is not None:
        try:
            check_options(ranks, **args)
        except ValueError as error:
            parser.error(str(error))
    if under_torchrun() and ranks != int(os.environ["WORLD_SIZE"]):
        parser.error(f"--ranks {ranks} differs from torchrun's --nproc-per-node x --nnodes "
                     f"= {os.environ['WORLD_SIZE']}; drop --ranks under torchrun")
    rows: list[Row] = []

    def body() -> int:
        rows.extend(combine(launch(demo, ranks, backend=backend, **args)))
        return 0

    status = run_command(prog, body)
    if status:
        raise SystemExit(status)
    if rank() == 0:
        print(format_rows(rows))
        exact = [r for r in rows if r.matches is not None]
        print(f"{sum(bool(r.matches) for r in exact)}/{len(exact)} checked cases match one "
              "process")
    return rows
