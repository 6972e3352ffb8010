"""Which CPU this is, in the terms that decide its speed: its model name, and what it
multiplies bf16 with (AMX, AVX-512's bf16 dot products, or nothing fast). The trainer's
peaks are cached per CPU kind, `minipar doctor` names it, and every benchmark's header
says which machine produced its figures."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import torch


@cache  # a machine's CPU does not change while a process runs
def _cpuinfo(*names: str) -> str:
    """The first /proc/cpuinfo field called one of `names` (Linux); "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.partition(":")[2].strip() for ln in lines if ln.startswith(names)), "")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86's "flags", Arm's "Features"); empty where unknown."""
    return set(_cpuinfo("flags", "Features").split())


def cpu_kind() -> str:
    """What this CPU multiplies bf16 with: "AMX" (Intel's tile units, several times fp32),
    "AVX-512 with bf16" (bf16 dot products, about 2x), "AVX-512 without bf16" or "AVX2
    only" (no fast bf16 kernel at all), else torch's name for its vector unit."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 with bf16"
    if "avx512f" in flags:
        return "AVX-512 without bf16"
    if "avx2" in flags:
        return "AVX2 only"
    return f"{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}"


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14"), or its architecture where unknown."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()

