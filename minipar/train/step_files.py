"""How many of minipar's files one training step enters: a measure of how far a reader
must travel to follow a step (nanoGPT's step crosses 2 files, picotron's pp x tp x dp
step 11).

`step_files(config)` runs on every rank of a launched run: two steps untraced, then the
third under `sys.setprofile`, collecting the file of every Python function called on the
rank's main thread (data parallelism's communication thread runs the same collectives
files the main thread does). `python -m minipar.train.step_files` prints the count for
dp=2 and for pp2 x tp2 x ZeRO-1 on the tiny preset.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..cli import run_command
from ..runtime import launch
from .config import TrainConfig, load_config
from .data import BatchSampler, load_tokens
from .loop import build_part, train_step
from .optim import learning_rate
from .precision import LossScaler

PACKAGE = Path(__file__).resolve().parents[1]  # the minipar package folder
TRACED = 3  # the step traced: past the first steps' shape learning and allocation


def step_files(config: TrainConfig) -> list[str]:
    """The files under minipar/ (relative, sorted) whose functions this rank's main thread
    called during step `TRACED` of `config` (every rank of the run calls it)."""
    part = build_part(config)
    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    sampler = BatchSampler(tokens.train, config.model.seq_len, config.train.batch_size,
                           config.data.seed, part.dp_rank, part.dp)
    scaler, seen = LossScaler(enabled=config.train.precision == "fp16"), set()

    def profile(frame, event, _arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    for step in range(TRACED):
        lr = learning_rate(step, config.optim, config.train.steps)
        batch = sampler.next()
        if step + 1 == TRACED:
            sys.setprofile(profile)
        try:
            train_step(part, scaler, *batch, config, lr)
        finally:
            sys.setprofile(None)
    return sorted(str(Path(f).resolve().relative_to(PACKAGE.parent)) for f in seen
                  if Path(f).resolve().is_relative_to(PACKAGE))


LAYOUTS = {"dp=2": {"parallel.dp": 2},
           "pp=2 x tp=2, ZeRO-1": {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp": 1,
                                   "parallel.zero": 1, "parallel.microbatches": 2}}


def count(layout: str) -> tuple[int, list[str]]:
    """The files any rank's step entered for one of `LAYOUTS` (a launch of its ranks)."""
    overrides = {"train.steps": 10, "optim.warmup_steps": 1, **LAYOUTS[layout]}
    config = load_config("tiny", overrides)
    p = config.parallel
    files = sorted({f for rank_files in launch(step_files, p.dp * p.pp * p.tp * p.cp, config)
                    for f in rank_files})
    return len(files), files


def _print_every_layout() -> int:
    for name in LAYOUTS:
        n, files = count(name)
        print(f"{name}: {n} files\n  " + "\n  ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m minipar.train.step_files", _print_every_layout))
