"""`minipar tour`: every technique on CPU ranks, checked against one process, in one report.

The tour is a list of technique packages; each one's `demo.tour(ctx)` runs its demo on
shared ranks, compares it with a single-process reference, times it, and may leave
pictures and Chrome traces in the output folder. A new technique adds its package here.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .basics import demo as basics
from .collectives import demo as collectives
from .context_parallel import demo as context_parallel
from .data_parallel import demo as data_parallel
from .demo import Context, Row, format_rows
from .mesh import demo as mesh
from .moe import demo as moe
from .pipeline import demo as pipeline
from .sharded import demo as sharded
from .slow_networks import demo as slow_networks
from .tensor_parallel import demo as tensor_parallel
from .train import demo as trained

# In lesson order (00-11), one package per lesson topic.
TECHNIQUES = {"basics": basics, "collectives": collectives, "data parallelism": data_parallel,
              "pipelines": pipeline, "tensor parallelism": tensor_parallel, "experts": moe,
              "sharded data parallelism": sharded, "a mesh of them": mesh,
              "long sequences": context_parallel, "slow networks": slow_networks,
              "a trained model": trained}


def run_tour(out_dir: str | Path = "minipar-out", only: list[str] | None = None) -> list[Row]:
    """Run every technique's tour rows (or those of the techniques in `only`, by module
    name: "basics", "collectives", ...), print the report, and write report.json/.txt,
    pictures and traces into `out_dir`."""
    short = {module.__name__.split(".")[1]: name for name, module in TECHNIQUES.items()}
    unknown = sorted(set(only or ()) - set(short))
    if unknown:
        raise ValueError(f"--only {unknown[0]} is not a technique; choose from "
                         f"{', '.join(short)}")
    chosen = {name: TECHNIQUES[name] for key, name in short.items() if not only or key in only}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(out_dir)
    rows: list[Row] = []
    try:
        for name, technique in chosen.items():
            print(f"  .. {name}", flush=True)
            rows.extend(technique.tour(ctx))
    finally:
        ctx.close()
    report = format_rows(rows)
    print(report)
    (out_dir / "report.txt").write_text(report + "\n")
    (out_dir / "report.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    exact = [r for r in rows if r.matches is not None]
    print(f"\n{sum(bool(r.matches) for r in exact)}/{len(exact)} exact techniques match one "
          f"process ({len(rows) - len(exact)} more are approximate by design).\n"
          f"Pictures, Chrome traces (open in Perfetto) and the report are in {out_dir}/")
    return rows
