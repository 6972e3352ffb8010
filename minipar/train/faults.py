"""Rehearsing failures: `--fault KIND@RANK:STEP` makes one rank fail at one step the way
real runs fail, so a learner (and the tests) can watch what the launcher and the
checkpoints do about it.

- `kill`: SIGKILL at the start of the step (the OOM killer, a lost node): no Python
  exception, no cleanup; the launcher sees the process vanish.
- `raise`: an exception inside the step's forward pass (a bug, a bad batch).
- `hang`: the rank stops at the start of the step (stuck in I/O or a driver) while the
  others wait for it inside the step's first collective: a deadlock, which the launcher's
  timeout ends, naming the call each rank waits in.
- `disk-full`: the rank's checkpoint file at that step fails halfway with ENOSPC; the
  previous checkpoint stays the latest.

A fault fires only in a job's first attempt: torchrun's restarted workers
(`runtime.torchrun.elastic_attempt() > 0`) run clean, as a real restart would after the
cause is gone.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime import rank
from ..runtime.torchrun import elastic_attempt

FAULT_KINDS = ("kill", "raise", "hang", "disk-full")


class InjectedFault(RuntimeError):
    """The exception `raise` throws: named so no one mistakes it for a real bug."""


@dataclass(frozen=True)
class Fault:
    """One rank's failure at one step (1-based, as the progress lines count steps)."""

    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        """"kill@1:5": rank 1 is killed at the start of step 5."""
        kind, _, where = text.partition("@")
        rank_text, _, step_text = where.partition(":")
        if kind not in FAULT_KINDS or not rank_text.isdigit() or not step_text.isdigit() \
                or int(step_text) < 1:
            raise ValueError(f"--fault must be KIND@RANK:STEP with KIND one of "
                             f"{', '.join(FAULT_KINDS)} and STEP >= 1 (e.g. kill@1:5); "
                             f"got {text!r}")
        return cls(kind, int(rank_text), int(step_text))

    def fires(self, step: int) -> bool:
        """On this rank, at this step, in the job's first attempt."""
        return elastic_attempt() == 0 and rank() == self.rank and step == self.step

    @contextmanager
    def during_step(self, step: int) -> Iterator[None]:
        """Around step `step`'s forward, backward and update."""
        if not self.fires(step) or self.kind == "disk-full":
            yield
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:  # the others block in the step's first collective, waiting for us
                time.sleep(1)

        def raise_in_forward(module, args):
            raise InjectedFault(f"rank {self.rank} raised mid-forward at step {step} "
                                f"(--fault {self.kind}@{self.rank}:{step}) in "
                                f"{type(module).__name__}")

        # a global hook: the first module this rank runs in the step raises
        handle = torch.nn.modules.module.register_module_forward_pre_hook(raise_in_forward)
        try:
            yield
        finally:
            handle.remove()

    @contextmanager
    def during_checkpoint(self, step: int) -> Iterator[None]:
        """Around the checkpoint written after step `step`: disk-full makes this rank's
        file fail halfway, as a full disk does."""
        if not (self.kind == "disk-full" and self.fires(step)):
            yield
            return
        real = torch.save

        def save(obj, f, *args, **kwargs):
            Path(f).write_bytes(b"half a fi")  # what a full disk leaves: a partial file
            raise OSError(errno.ENOSPC, f"No space left on device (rank {self.rank} writing "
                                        f"the checkpoint of step {step}, --fault "
                                        f"disk-full@{self.rank}:{step})")

        torch.save = save  # only inside this rank's checkpoint write
        try:
            yield
        finally:
            torch.save = real
