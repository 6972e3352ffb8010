"""What a run shows: tokens per second, model FLOPs utilization (MFU) against a peak
measured on this machine, and one JSON line per step in `metrics.jsonl` (and, when the
`tensorboard` package is installed, the same scalars as event files in `tb/`).
Each step's wall time comes split by `StepClock` into the CPU time of the thread that
ran it, the CPU time of the process's other threads, and the time neither ran.

MFU = (model FLOPs per token x tokens per second) / peak FLOP/s of the cores in use
(PaLM, Chowdhery et al. 2022, appendix B). Model FLOPs per token are
`DecoderConfig.flops_per_token`: 6 N (forward and backward of every matmul weight) plus
the attention scores' 12 L T h; recomputation's extra forward is not counted (that is
"hardware FLOPs"). On a CPU the peak is never a data sheet's: it is the model's own
matmuls timed here, on one thread (each rank computes on one), in the run's dtype, each at
its best, and cached (matmul_peak.py); on a GPU, device_peak.py takes the maker's figure
where it knows the card. Above 100% means the formula or the peak is wrong: the run's
progress line says so, and never clamps it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cores_in_use(ranks: int) -> int:
    """Cores the run's ranks compute on: one each, at most the machine's (ranks beyond it
    time-share, so the peak they could reach together is the cores')."""
    return max(1, min(ranks, os.cpu_count() or 1))


def mfu(flops_per_token: float, tokens_per_s: float, peak_per_core: float, cores: int
        ) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the peak of `cores` cores."""
    return flops_per_token * tokens_per_s / (peak_per_core * cores)


class StepClock:
    """A step's time three ways (`with StepClock() as clock: step()`): `seconds` of wall
    time; `cpu_seconds`, the CPU time of the thread that ran the step (its Python and,
    on a CPU, its kernels); `other_cpu_seconds`, the CPU time of the process's other
    threads (the communication thread's collectives, gloo's socket threads, torch's
    intra-op pool). What neither covers, `idle_seconds`, is time no thread of this
    process ran: waiting for another rank's message (or for a GPU, where the wait sleeps;
    a wait that spins counts as CPU) or kept off the cores while another process ran.
    On one thread per rank, that split says where a synchronous step's time goes: dp=2
    against two processes that never wait (`minipar bench train`)."""

    def __enter__(self) -> StepClock:
        self._start = (time.perf_counter(), time.thread_time(), time.process_time())
        return self

    def __exit__(self, *exc: object) -> None:
        wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
        self.seconds = wall - self._start[0]
        self.cpu_seconds = thread - self._start[1]
        self.other_cpu_seconds = process - self._start[2] - self.cpu_seconds

    @property
    def idle_seconds(self) -> float:
        # never below zero: the process's CPU time can outrun the wall clock only when
        # several of its threads ran at once (the intra-op pool on every core)
        return max(0.0, self.seconds - self.cpu_seconds - self.other_cpu_seconds)


# the per-step numbers TensorBoard draws, under the names metrics.jsonl gives them
SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "loss_scale")


def tensorboard_writer(folder: Path) -> Any | None:
    """A `torch.utils.tensorboard.SummaryWriter` into `folder`, or None when the
    `tensorboard` package is not installed (`pip install minipar[tensorboard]`)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder))


class MetricsLog:
    """One JSON object per line in `metrics.jsonl` (written as it goes, so a killed run
    keeps what it logged) and, when TensorBoard is installed, the same numbers as event
    files in `tb/` beside it (`tensorboard --logdir runs`).

    Without TensorBoard nothing is said, at the start or per step: metrics.jsonl and
    loss.png already hold every number, and a hint repeated on every run of a learner
    who chose not to install an optional viewer is noise (docs/trainer.md names the extra).
    `writer` makes the event writer (tests pass a fake one). A resumed run passes
    `keep_until`, the step its checkpoint had done: the lines up to it stay, any later ones
    (logged after that checkpoint by the run that stopped) go, and the run appends."""

    def __init__(self, path: Path,
                 writer: Callable[[Path], Any | None] = tensorboard_writer,
                 keep_until: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        kept = ([r for r in read_metrics(path) if r["step"] <= keep_until]
                if keep_until is not None and path.exists() else [])
        self.file = path.open("w")
        for record in kept:
            self.file.write(json.dumps(record) + "\n")
        self.board = writer(path.parent / "tb")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            for name in SCALARS:
                if record.get(name) is not None:  # grad_norm is None after an fp16 overflow
                    self.board.add_scalar(name, record[name], record["step"])
            self.board.flush()

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def read_metrics(path: Path) -> list[dict]:
    """The records of a `metrics.jsonl`."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
