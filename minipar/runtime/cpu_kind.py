"""Which CPU this is, in the terms that decide its speed: its model name, and what it
multiplies bf16 with (AMX, AVX-512's bf16 dot products, or nothing fast). The trainer's
peaks are cached per CPU kind, `minipar doctor` names it, and every benchmark's header
says which machine produced its figures."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo); empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


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
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

