"""What every benchmark and the tour share to report: tables, JSON and plot files,
progress lines and simple timers. Benchmarks compare things measured in the same run;
this module only prints and saves them."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def progress(message: str) -> None:
    """A progress line on stderr for long sweeps (kept out of the printed table)."""
    print(f"  .. {message}", file=sys.stderr, flush=True)


def aligned(cells: list[str], widths: list[int]) -> str:
    """One line of a plain-text table: each cell padded to its column's width, two spaces
    apart (every table minipar prints is laid out by this)."""
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table of `rows` with (key, header) columns."""
    cells = [[header for _, header in columns]]
    cells += [[str(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [aligned(r, widths) for r in cells]
    lines.insert(1, aligned(["-" * w for w in widths], widths))
    return "\n".join(lines)


def save_results(rows: list[dict], fig, out_dir: Path, name: str, title: str) -> None:
    """Write a benchmark's rows as bench_NAME.json and its figure, with `title` (what it
    compares, on what) on top, as bench_NAME.png."""
    if not title.strip():
        raise ValueError("title must say what the plot compares; got an empty one")
    fig.suptitle(title, fontsize=11)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"bench_{name}.json").write_text(json.dumps(rows, indent=2))
    fig.savefig(out_dir / f"bench_{name}.png", dpi=100)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def human_seconds(seconds: float) -> str:
    """3 significant-ish digits in s, ms or us."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.2f} us"


def human_bytes(nbytes: int) -> str:
    """4 KiB, 16 MiB: the sizes benchmarks sweep."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def spread(values: list[float], unit: str = "x", digits: int = 2) -> str:
    """median (min-max) of repeated measurements: a ratio with the machine's noise beside it."""
    ordered = sorted(values)
    return (f"{statistics.median(ordered):.{digits}f}{unit} "
            f"({ordered[0]:.{digits}f}-{ordered[-1]:.{digits}f})")


def ratio_cell(values: list[float], ceiling: float | None = None) -> str:
    """`spread` of per-round ratios; a median above the physical `ceiling` (say a speedup
    above 2m/(m+1)) is no result but noise (the baseline had a slow round), and says so."""
    text = spread(values)
    if ceiling is not None and statistics.median(values) > ceiling * 1.001:
        return f"noise: {text} > ceiling {ceiling:.2f}x"
    return text
