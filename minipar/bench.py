"""`minipar bench NAME`: the registry of benchmarks, one per technique package.

Each lives beside its technique (`minipar/<technique>/bench.py`) as a `measure()` that
returns rows and a `report(rows, out_dir)` that prints a table and writes JSON and a
plot. Every figure is a comparison in one run; times on a shared 2-core machine move
by 10-30% from run to run, so read ratios, not digits.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from .runtime import machine_line

BENCHMARKS = {"launch": "minipar.runtime.bench",
              "collectives": "minipar.collectives.bench",
              "data-parallel": "minipar.data_parallel.bench",
              "zero": "minipar.sharded.bench",
              "offload": "minipar.sharded.offload_bench",
              "pipeline": "minipar.pipeline.bench",
              "pipefisher": "minipar.pipeline.pipefisher_bench",
              "tensor-parallel": "minipar.tensor_parallel.bench",
              "tp-overlap": "minipar.tensor_parallel.collective_matmul_bench",
              "moe": "minipar.moe.bench",
              "moe-balance": "minipar.train.balance_bench",
              "mesh": "minipar.mesh.bench",
              "context-parallel": "minipar.context_parallel.bench",
              "masha": "minipar.slow_networks.masha_bench",
              "atom": "minipar.slow_networks.atom_bench",
              "diloco": "minipar.slow_networks.diloco_bench",
              "train": "minipar.train.bench",
              "train-dp": "minipar.train.dp_bench",
              "train-vs-torch": "minipar.train.torch_race",
              "dp-overlap": "minipar.train.overlap_bench",
              "cluster": "minipar.train.cluster_bench"}


def run_benchmark(name: str, out_dir: str | Path = "bench-out", rounds: int | None = None
                  ) -> list[dict]:
    """Run benchmark `name`, print its table and write its JSON and plot into `out_dir`;
    `rounds` replaces its number of rounds in turns (more rounds, a steadier median on a
    noisy machine), where it has rounds."""
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark must be one of {', '.join(sorted(BENCHMARKS))}; "
                         f"got {name!r}")
    module = importlib.import_module(BENCHMARKS[name])
    if rounds is None:
        rows = module.measure()
    elif "rounds" in inspect.signature(module.measure).parameters:
        rows = module.measure(rounds=rounds)
    else:
        raise ValueError(f"bench {name} takes no rounds in turns: run it without --rounds")
    print(machine_line())  # which machine the figures are from
    print(module.report(rows, Path(out_dir)))
    print(f"(JSON and plot in {out_dir}/; medians on this machine, expect 10-30% run-to-run "
          "noise)")
    return rows
