"""The GPU check's matrix: every case, the part it belongs to, the GPUs it needs, and what
`--on-cpu` runs in its place (or why it cannot).

A case is a function on the launcher's side that starts launches of its own, each with
its own timeout, and returns the lines it measured or raises. So one hang or failure
ends one case, and every other case still runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..runtime import launch
from . import trainer_cases as T
from .collectives_matrix import ON_CPU_DTYPES, ON_GPU_DTYPES, versus_torch_on_rank
from .p2p_matrix import KIB, MIB, PATTERNS, pattern_on_rank, size_name
from .streams_trace import KINDS, overlap_on_rank

PARTS = ("1. one rank", "2. point-to-point", "3. collectives against torch's",
         "4. compositions under NCCL", "5. one GPU shared by gloo ranks", "6. streams",
         "7. MFU and memory", "8. torchrun")
SHARED = {"dp2": {"parallel.dp": 2}, "tp2": {"parallel.tp": 2},
          "pp2": {"parallel.pp": 2, "parallel.microbatches": 2},
          "dp2 x tp2": {"parallel.dp": 2, "parallel.tp": 2}, "cp2": {"parallel.cp": 2},
          "dp2 x tp2 x pp2": {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2,
                              "parallel.microbatches": 2}}


@dataclass(frozen=True)
class CheckCase:
    part: str
    name: str
    gpus: int  # the GPUs it needs
    run: Callable[[], list[str]] | None  # None: not run in this mode, for `why`
    why: str = ""


def _p2p(k: int, pattern: str, sizes: tuple[int, ...], backend: str, device: str
         ) -> list[str]:
    results = launch(pattern_on_rank, k, pattern, sizes, backend=backend, device=device,
                     timeout=120)
    wrong = {r: res["wrong"] for r, res in enumerate(results) if res["wrong"]}
    assert not wrong, f"wrong values received: rank: sizes {wrong}"
    slowest = {n: max(res["seconds"][n] for res in results) for n in sizes}
    return ["  ".join(f"{size_name(n)} {slowest[n] * 1e3:.2f} ms" for n in sizes)]


def _collectives(k: int, sizes: tuple[int, ...], dtypes: tuple, backend: str, device: str
                 ) -> list[str]:
    results = launch(versus_torch_on_rank, k, sizes, dtypes, backend=backend, device=device,
                     timeout=300)
    wrong = sorted({w for res in results for w in res["wrong"]})
    assert not wrong, f"{len(wrong)} differ from torch's, first: {wrong[0]}"
    times = results[0]["seconds"]
    return [f"every collective equals torch's in {len(dtypes)} dtypes, on all ranks and a "
            "subgroup; all_to_all uneven with empty pieces",
            "ring all-reduce, minipar / torch's: " + "  ".join(
                f"{size_name(n)} {a * 1e3:.2f} / {b * 1e3:.2f} ms" for n, (a, b) in times.items())]


def _traced(kind: str, backend: str) -> list[str]:
    results = launch(overlap_on_rank, 2, kind, backend=backend, device="cuda", timeout=300)
    for r, result in enumerate(results):
        assert result["nccl kernels"] > 0, f"rank {r}: no NCCL kernel in the trace"
        assert result["overlap_s"] > 0, f"rank {r}: no NCCL kernel ran under compute"
    return [f"rank {r}: {res['nccl kernels']} NCCL kernels, {res['other kernels']} others, "
            f"{res['overlap_s'] / res['nccl_s']:.0%} of NCCL's {res['nccl_s'] * 1e3:.2f} ms "
            "under compute" for r, res in enumerate(results)]


def _torchrun(processes: int, on_cpu: bool) -> list[str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if on_cpu:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(processes), "-m",
                           "minipar.data_parallel"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, f"torchrun exited {done.returncode}: " \
        f"{(done.stderr.strip().splitlines() or ['(no output)'])[-1]}"
    assert "matches one process?" in done.stdout and " NO " not in done.stdout, \
        "a data-parallel trainer under torchrun differs from one process"
    return [f"{processes} processes: every data-parallel trainer equals one process"]


def _ranks(overrides: dict) -> int:
    from ..train.compare import ranks_of

    return ranks_of(T.config("tiny", **{"train.precision": "fp64", **overrides}))


def cases(on_cpu: bool, gpus: int) -> list[CheckCase]:
    """The matrix for this mode: on GPUs (NCCL where a case needs several), or `on_cpu`
    (gloo CPU ranks standing in where they can)."""
    dev = "cpu" if on_cpu else "cuda"
    multi = "gloo" if on_cpu else "nccl"
    gpu_only = "--on-cpu: needs a GPU"
    out: list[CheckCase] = []

    def add(part: int, name: str, needs: int, run: Callable | None, why: str = "") -> None:
        out.append(CheckCase(PARTS[part - 1], name, needs, run, why))

    add(1, "smoke, NCCL", 1, None if on_cpu else partial(T.smoke, "nccl", "cuda"),
        "--on-cpu: NCCL needs a GPU per rank")
    add(1, "smoke, gloo", 1, partial(T.smoke, "gloo", dev))
    preset = "tiny" if on_cpu else "small"
    add(1, f"{preset} in fp32 and bf16", 1, partial(T.fp32_and_bf16, preset, dev))

    sizes = (4 * KIB, 4 * MIB) if on_cpu else (4 * KIB, 4 * MIB, 64 * MIB)
    for k in (2, 3, 4, 8):
        for pattern in PATTERNS:
            runs = not on_cpu or k <= 4
            add(2, f"K={k} {pattern}", k,
                partial(_p2p, k, pattern, sizes, multi, dev) if runs else None,
                "--on-cpu: K of 2-4 only")

    for k in (2, 3, 5, 8):
        runs = not on_cpu or k <= 3
        csizes, dtypes = ((4 * KIB, MIB), ON_CPU_DTYPES) if on_cpu else \
            ((4 * KIB, 4 * MIB, 256 * MIB), ON_GPU_DTYPES)
        add(3, f"K={k}", k, partial(_collectives, k, csizes, dtypes, multi, dev)
            if runs else None, "--on-cpu: K of 2 and 3 only")

    composed = "--on-cpu: CI's slow tier holds every composition to one process on CPU ranks"
    for name, overrides in T.compositions().items():
        add(4, name, _ranks(overrides), None if on_cpu else
            partial(T.held_to_one_process, overrides, "nccl", "cuda"), composed)
    add(4, "bf16 dp2 (a loose bound)", 2, None if on_cpu else
        partial(T.bf16_dp2, "nccl", "cuda"), composed)
    add(4, "resumed on another mesh", 4, None if on_cpu else
        partial(T.resumed_on_another_mesh, "nccl", "cuda"), composed)

    for name, overrides in SHARED.items():
        runs = not on_cpu or _ranks(overrides) <= 4
        add(5, name, 1, partial(T.held_to_one_process, overrides, "gloo", dev) if runs
            else None, "--on-cpu: up to 4 ranks")

    add(6, "offload, width 48", 1, partial(T.offload, dev))
    add(6, "offload, width 4096 (copies long enough to race)", 1,
        None if on_cpu else partial(T.offload, dev, 4096), gpu_only)
    for kind in KINDS:
        add(6, f"trace: {kind}", 2, None if on_cpu else partial(_traced, kind, "nccl"),
            "--on-cpu: only a GPU's kernels show overlap")

    add(7, "bf16, 12 layers x 2048", 1, None if on_cpu else T.mid_size_mfu, gpu_only)
    processes = 2 if on_cpu else max(gpus, 1)
    add(8, f"torchrun --nproc-per-node {processes}", 1, partial(_torchrun, processes, on_cpu))
    return out
