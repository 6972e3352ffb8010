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
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .cli import OneLineParser, nonnegative_int, positive_int, run_command
from .report import aligned
from .runtime import BACKENDS, DEFAULT_TIMEOUT, Cluster, Results, launch, rank, under_torchrun

WIDTH = 120  # the report fits a terminal this many columns wide


@dataclass
class Check:
    """What one rank says about one demo case."""

    technique: str
    matches: bool | None  # None: nothing to compare on this rank, or not exact by design
    seconds: float
    bytes_sent: int | None = None  # metered traffic, where a meter exists
    note: str = ""
    skipped: str = ""  # why the case did not run on these ranks (empty: it ran)


def skip(technique: str, why: str) -> Check:
    """A case that cannot run on these ranks, saying why and what to change."""
    return Check(technique, None, 0.0, skipped=why)


def run_cases(runs: dict[str, Callable[[], Check]], cases: Sequence[str]) -> list[Check]:
    """Run the named cases of a demo, in order; an unknown name is one line listing them."""
    unknown = [c for c in cases if c not in runs]
    if unknown:
        raise ValueError(f"cases must be among {', '.join(runs)}; got {unknown}")
    return [runs[case]() for case in cases]


def start_clock() -> float:
    """Every rank passes a barrier, then reads the clock: each rank times a case from the
    same moment, so per-rank times compare (without it, a rank that arrives first counts
    its wait for the others, say the time they took to start or to build their
    reference)."""
    dist.barrier()
    return time.perf_counter()


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
    skipped: str = ""


def combine(results: list[list[Check]]) -> list[Row]:
    """Per case: matches on every rank that checked something (None if no rank did: not
    exact by design), the slowest rank's time, all ranks' bytes."""
    rows = []
    for checks in zip(*results, strict=True):
        first = checks[0]
        sent = [c.bytes_sent for c in checks if c.bytes_sent is not None]
        judged = [c.matches for c in checks if c.matches is not None]
        matches = all(judged) if judged else None  # a rank may hold nothing to compare
        # a parallel case takes as long as its slowest rank
        rows.append(Row(first.technique, len(checks), matches, max(c.seconds for c in checks),
                        bytes_moved=sum(sent) if sent else None, note=first.note,
                        skipped=first.skipped))
    return rows


COLUMNS = (("ranks", "ranks"), ("matches", "matches one process?"), ("time", "time"),
           ("speedup", "speedup"), ("bytes", "bytes moved"))


def format_rows(rows: list[Row], width: int = WIDTH) -> str:
    """The report table every demo and the tour print, at most `width` columns wide: a
    technique's name wraps inside its column, and its note goes on the lines below it,
    indented."""
    cells = [{"ranks": str(r.ranks), "matches": {True: "yes", False: "NO", None: "-"}[r.matches],
              "time": "-" if r.skipped else f"{r.seconds * 1e3:.0f} ms",
              "speedup": "-" if r.speedup is None else f"{r.speedup:.2f}x",
              "bytes": "-" if r.bytes_moved is None else f"{r.bytes_moved:,}"} for r in rows]
    widths = [max([len(header)] + [len(c[key]) for c in cells]) for key, header in COLUMNS]
    # 2 columns of gap after each cell; at least 20 for the name even in a narrow terminal
    room = max(width - sum(widths) - 2 * len(widths), 20)
    name_width = min(room, max([len("technique")] + [len(r.technique) for r in rows]))

    def line(name: str, values: list[str]) -> str:
        return aligned([name, *values], [name_width, *widths]).rstrip()

    lines = [line("technique", [h for _, h in COLUMNS]),
             line("-" * name_width, ["-" * w for w in widths])]
    for row, cell in zip(rows, cells, strict=True):
        names = textwrap.wrap(row.technique, name_width) or [""]
        lines.append(line(names[0], [cell[key] for key, _ in COLUMNS]))
        lines += names[1:]
        note = f"skipped: {row.skipped}" if row.skipped else row.note
        lines += textwrap.wrap(note, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


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
    # the baseline computes on one core; `finally` puts the thread count back even on error
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
    """The options every `python -m minipar.<technique>` command shares: --ranks (torchrun's
    WORLD_SIZE when set), --backend and --timeout. Modules add their own before parsing;
    mistakes are one line (see `minipar.cli`)."""
    parser = OneLineParser(prog=prog, description=" ".join(description.split()))
    parser.add_argument("--ranks", type=positive_int,
                        # torchrun exports WORLD_SIZE to every worker: its world size is the default
                        default=int(os.environ.get("WORLD_SIZE", default_ranks)),
                        help=f"how many ranks to spawn (default {default_ranks}; under "
                             "torchrun, its world size)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto: nccl with one GPU per rank, else gloo (CPU processes)")
    parser.add_argument("--timeout", type=positive_int, default=int(DEFAULT_TIMEOUT),
                        metavar="SECONDS",
                        help=f"end the run with an error saying where each rank waits if "
                             f"no rank makes progress for this long (default "
                             f"{DEFAULT_TIMEOUT:g})")
    return parser


def check_torchrun_ranks(parser: argparse.ArgumentParser, ranks: int) -> None:
    """Under torchrun, --ranks must be torchrun's world size: say so in its terms."""
    if under_torchrun() and ranks != int(os.environ["WORLD_SIZE"]):
        parser.error(f"--ranks {ranks} differs from torchrun's --nproc-per-node x --nnodes "
                     f"= {os.environ['WORLD_SIZE']}; drop --ranks under torchrun")


def run_demo(demo: Callable[..., list[Check]], description: str, default_ranks: int = 2,
             argv: list[str] | None = None, options: dict[str, tuple[int, str]] | None = None,
             cases: Sequence[str] = (),
             check_options: Callable[..., None] | None = None) -> list[Row]:
    """Parse --ranks, --backend, --timeout, the demo's own integer `options` (name:
    (default, help)) and, when the demo names its `cases`, --cases; run `demo(**options)`
    on every rank (spawned, or the ranks torchrun started), print the table on rank 0,
    and exit with status 1 if a case does not match one process. `check_options(ranks,
    **options)` may raise ValueError before any rank starts; its message, like any
    ValueError of the launch (a backend this machine lacks), becomes a one-line error,
    and Ctrl-C a one-line "interrupted"."""
    prog = "python -m " + demo.__module__.rsplit(".", 1)[0]
    parser = demo_parser(description, default_ranks, prog)
    for name, (default, what) in (options or {}).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=nonnegative_int, default=default,
                            help=f"{what} (default {default})")
    if cases:
        parser.add_argument("--cases", nargs="+", choices=cases, default=list(cases),
                            metavar="CASE", help=f"run only these: {', '.join(cases)} "
                                                 "(default: all)")
    args = vars(parser.parse_args(argv))
    ranks, backend, timeout = args.pop("ranks"), args.pop("backend"), args.pop("timeout")
    if cases:
        args["cases"] = tuple(args["cases"])
    if check_options is not None:
        try:
            check_options(ranks, **args)
        except ValueError as error:
            parser.error(str(error))
    check_torchrun_ranks(parser, ranks)
    rows: list[Row] = []

    def body() -> int:
        rows.extend(combine(launch(demo, ranks, backend=backend, timeout=timeout, **args)))
        return 0

    status = run_command(prog, body)
    if status:
        raise SystemExit(status)
    if rank() == 0:
        print(format_rows(rows))
        print(match_summary(rows))
        print("time: the slowest rank's; every rank starts its clock at the same barrier")
    if any(row.matches is False for row in rows):
        raise SystemExit(1)
    return rows


def match_summary(rows: list[Row]) -> str:
    """How many checked cases match one process, and how many did not run."""
    exact = [r for r in rows if r.matches is not None]
    skipped = sum(bool(r.skipped) for r in rows)
    return (f"{sum(bool(r.matches) for r in exact)}/{len(exact)} checked cases match one "
            f"process" + (f", {skipped} skipped (see why in its note)" if skipped else ""))
