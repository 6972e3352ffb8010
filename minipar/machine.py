"""A machine's communication constants, fitted by measurement, and the models built on them.

`Machine` holds alpha (seconds per message, minipar's own per-step Python included),
beta (seconds per byte of one transfer running alone) and gamma (seconds per byte
added), with the number of cores the ranks share. `minipar.collectives.fit_machine`
measures them on the current backend in a few seconds and saves them;
`Machine.load()` reads them back, so every model in minipar (collective costs, the
data-parallel step, the pipeline's messages, the planner) can use the same figures.

What the model sees on CPU ranks: a transfer over loopback is CPU copying on both ends
(the sender into the socket, the receiver out of it), so T transfers at once need 2T
cores to run at the speed of one; ranks beyond the core count take turns (their
per-message work and their additions stretch by ranks / cores). What it leaves out:
cache and memory-bandwidth contention, the operating system waking a rank late, gloo's
own threads, segments within a long message, and the argument handshake minipar runs
before a collective when validation is on (benchmarks switch it off).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .cost import CommStep, all_reduce_steps

MACHINE_FILE_ENV = "MINIPAR_MACHINE"


def machine_file() -> Path:
    """Where fitted machines are kept: $MINIPAR_MACHINE, else ~/.cache/minipar/machine.json."""
    chosen = os.environ.get(MACHINE_FILE_ENV)
    return Path(chosen) if chosen else Path.home() / ".cache" / "minipar" / "machine.json"


@dataclass(frozen=True)
class Machine:
    """Fitted constants of one backend on one machine (see the module docstring)."""

    backend: str
    alpha: float  # seconds per message, one transfer alone (minipar's Python included)
    beta: float  # seconds per byte, one transfer alone
    gamma: float  # seconds per byte added, one core
    cores: int  # cores the ranks share (GPUs: one per rank, so never a limit)
    busy_ranks: int = 2  # ranks in the ring shift that gave busy_alpha and busy_beta
    busy_alpha: float | None = None  # per step when all busy_ranks send and receive at once
    busy_beta: float | None = None  # per byte of each message in such a step

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds; got {getattr(self, name)!r}")
        if self.cores < 1 or self.busy_ranks < 2:
            raise ValueError(f"cores must be >= 1 and busy_ranks >= 2; got {self.cores!r}, "
                             f"{self.busy_ranks!r}")

    def p2p_seconds(self, nbytes: float) -> float:
        """One message of `nbytes` between two otherwise idle ranks."""
        return self.step_seconds(CommStep(1, nbytes, 2))

    def step_seconds(self, step: CommStep) -> float:
        """Latency and per-byte cost of a step with `transfers` messages at once, measured
        at two points (one transfer alone; busy_ranks transfers, every rank sending and
        receiving) and linear in the transfers between and beyond them, as CPU copying
        shared by a fixed number of cores is; plus the additions, stretched by ranks /
        cores. Without a busy measurement, each transfer takes two cores' copying."""
        extra = step.transfers - 1
        if self.busy_alpha is None or self.busy_beta is None:
            alpha = self.alpha
            # loopback copies on both ends: T transfers at full speed need 2T cores
            beta = self.beta * max(1.0, 2 * step.transfers / self.cores)
        else:
            # linear between the two measured points: 0 at one transfer, 1 at busy_ranks transfers
            slope = extra / (self.busy_ranks - 1)
            alpha = self.alpha + (self.busy_alpha - self.alpha) * slope
            beta = self.beta + (self.busy_beta - self.beta) * slope
        # ranks beyond the cores take turns, so their additions stretch by ranks / cores
        share = max(1.0, step.ranks / self.cores)
        # clamped: extrapolating a noisy fit must not give a negative latency, nor a busy step
        # faster per byte than one transfer alone
        return max(alpha, 0.0) + step.nbytes * max(beta, self.beta) \
            + step.reduced * self.gamma * share

    def all_reduce_seconds(self, algorithm: str, world_size: int, nbytes: float) -> float:
        """Predicted seconds of minipar's `all_reduce(algorithm=...)` of `nbytes` on
        `world_size` ranks: the sum of its steps (see `all_reduce_steps`)."""
        return sum(self.step_seconds(s) for s in all_reduce_steps(algorithm, world_size, nbytes))

    def save(self, path: Path | None = None) -> Path:
        """Keep these constants (one entry per backend) in `path` or `machine_file()`."""
        path = Path(path) if path else machine_file()
        saved = json.loads(path.read_text()) if path.exists() else {}
        # merged into what is there: fitting gloo keeps a fitted nccl entry, and the other way round
        saved[self.backend] = asdict(self)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=1))
        return path

    @classmethod
    def load(cls, backend: str = "gloo", path: Path | None = None) -> Machine:
        """The constants saved for `backend`; a clear error says how to fit them if none are."""
        path = Path(path) if path else machine_file()
        saved = json.loads(path.read_text()) if path.exists() else {}
        if backend not in saved:
            raise FileNotFoundError(
                f"no fitted machine for backend {backend!r} in {path}; run "
                "`minipar bench collectives` or minipar.collectives.fit_machine() first")
        return cls(**saved[backend])
