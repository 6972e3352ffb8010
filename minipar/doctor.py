"""`minipar doctor`: what this machine gives minipar, on one screen: Python and torch
(and whether torch is a CPU or a CUDA build), the backends, GPUs and cores, what
backend="auto" will pick, what one core multiplies in fp32, bf16 and fp16 and what that
means for `--precision`, a fitted machine if one is saved, and the extras the lessons
and browser tests need."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import sys

import torch
import torch.distributed as dist

from . import __version__
from .machine import machine_file
from .runtime import cpu_cores, gpu_count, resolve_backend


def _build() -> str:
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build"
    return "CPU-only build"


def _installed(module: str) -> str:
    return "yes" if importlib.util.find_spec(module) else "no"


def _gpu_check(gpus: int) -> str:
    from .gpu_check import parts_here

    parts = parts_here(gpus)
    runs = [name.split(".")[0] for name, what in parts if what == "runs"]
    if not runs:
        return "nothing runs without a GPU (`minipar gpu-check --on-cpu` tests it on CPU ranks)"
    skipped = [f"part {name.split('.')[0]} {what}" for name, what in parts if what != "runs"]
    return f"parts {', '.join(runs)} run here (`minipar gpu-check`)" + \
        (f"; {'; '.join(skipped)}" if skipped else "")


# the matmuls doctor times: the small preset's projections at a few sequences (a dtype
# the cores lack is slow to time; the rate hardly depends on the rows: on the AVX2-only
# EPYC, 2 sequences gave bf16 0.057-0.059x fp32 and 4 gave 0.059-0.068x, in 9-10 s cold
# instead of 14-15)
DOCTOR_ROWS = 2


def _matmul_rates() -> list[tuple[str, str]]:
    """One core's fp32, bf16 and fp16 rates on the small preset's projections (as a rank
    computes, on one thread; cached with the trainer's peaks), and what they mean."""
    from .runtime import cpu_kind
    from .train.config import load_config
    from .train.device_peak import precision_verdict
    from .train.matmul_peak import matmul_rates

    model, threads = load_config("small").model, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {name: matmul_rates(dtype, model, DOCTOR_ROWS).as_run for name, dtype in
                 (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    finally:
        torch.set_num_threads(threads)
    fp32 = rates["fp32"]
    line = f"fp32 {fp32 / 1e9:.3g} GFLOP/s, " + ", ".join(
        f"{name} {rate / 1e9:.3g} ({rate / fp32:.2g}x)" for name, rate in rates.items()
        if name != "fp32") + f" on one core ({cpu_kind()}): the small preset's projections " \
        f"at {DOCTOR_ROWS * model.seq_len} tokens"
    return [("matmuls", line)] + [(name, precision_verdict(name, rates[name] / fp32))
                                  for name in ("bf16", "fp16")]


def report() -> list[tuple[str, str]]:
    """(what, value) lines describing this machine for minipar."""
    gpus = gpu_count()
    chromium = "yes" if shutil.which("chromium") else "no (apt-get install chromium)"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) if gpus else "none"
    cores = cpu_cores()
    auto = resolve_backend("auto", 2)
    saved = machine_file()
    return [
        ("minipar", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__}, {_build()}"),
        ("backends", f"gloo {'yes' if dist.is_gloo_available() else 'no'}, "
                     f"nccl {'yes' if dist.is_nccl_available() else 'no'}"),
        ("GPUs", f"{gpus} ({names})"),
        ("CPU cores", f"{cores}: more ranks than that take turns on them"),
        ("backend='auto'", f"{auto} for 2 ranks"
         + ("" if auto == "nccl" else " (nccl needs one GPU per rank)")),
        ("GPU check", _gpu_check(gpus)),
        *_matmul_rates(),
        ("fitted machine", str(saved) if saved.exists() else
         "none yet (`minipar bench collectives` fits and saves one)"),
        ("lessons", f"jupyterlab {_installed('jupyterlab')}, ipywidgets "
                    f"{_installed('ipywidgets')}, anywidget {_installed('anywidget')}"),
        ("browser tests", f"playwright {_installed('playwright')}, chromium {chromium}"),
    ]


def print_report() -> None:
    lines = report()
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
