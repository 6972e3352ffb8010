"""Lesson 10's resume exercise, graded on real ranks: a 2-rank run is killed (SIGKILL)
after its step-4 checkpoint, a step-6 checkpoint is left half-written, and the
learner's `resume(directory, model, optimizer)` must restart a 3-rank run where the
complete checkpoint left off."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..models import mlp, regression_data
from ..runtime import RankError, launch, rank
from .checkpoint import latest_step, train_resumable

STEPS, EVERY, LR = 8, 2, 0.05


def _model() -> torch.nn.Module:
    return mlp([6, 12, 1], seed=4, dtype=torch.float64)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_data(STEPS * 12, 6, seed=5, dtype=torch.float64)
    return list(zip(x.split(12), y.split(12), strict=True))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _interrupted(directory: Path) -> None:
    """Two ranks killed at step 5 (checkpoint at 4), then a step-6 folder holding only
    rank 0's file, with zeroed weights: a checkpoint that never completed."""
    try:
        launch(train_resumable, 2, _model, _batches(), _mse, LR, directory, EVERY,
               kill_at=(1, 5), backend="gloo", timeout=30)
    except RankError:
        pass
    if latest_step(directory) != 4:
        raise RuntimeError("the interrupted run did not leave its step-4 checkpoint")
    state = torch.load(directory / "step-4" / "rank-0.pt", weights_only=True)
    state["steps_done"] = 6
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    (directory / "step-6").mkdir()
    torch.save(state, directory / "step-6" / "rank-0.pt")


def _probe(resume: Callable, directory: Path) -> dict:
    """On one rank: the learner's resume into a fresh model and optimizer, against the
    step-4 checkpoint's state."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    start = resume(directory, model, optimizer)
    saved = torch.load(directory / "step-4" / "rank-0.pt", weights_only=True)
    same_model = all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    buffers = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
    want = [s.get("momentum_buffer") for s in saved["optimizer"]["state"].values()]
    same_momentum = all(b is not None and torch.equal(b, w)
                        for b, w in zip(buffers, want, strict=True))
    return {"start": start if isinstance(start, int) else repr(start), "rank": rank(),
            "model": same_model, "momentum": same_momentum}


def check_resume(resume: Callable) -> str:
    """`resume(directory, model, optimizer) -> steps done`: load the latest complete
    checkpoint (named in directory/latest) into model and optimizer, this rank's file or
    rank 0's when it has none; return its steps done (0 and no change when there is none)."""
    refuse_library("resume", resume)
    with tempfile.TemporaryDirectory(prefix="minipar-resume-") as folder:
        directory = Path(folder)
        _interrupted(directory)
        probes = run_on_ranks("resume", _probe, 3, resume, directory, crash_hints={
            "rank-2.pt": "has no file: the run that wrote the checkpoint had 2 ranks. Data-"
                         "parallel state is the same on every rank, so read rank 0's file "
                         "when yours does not exist",
            "No such file": "looked for a file that is not there: read the step number from "
                            "directory / 'latest', then directory / f'step-{N}' / "
                            "'rank-R.pt' (yours, or rank 0's)"})
        for p in probes:
            r, start = p["rank"], p["start"]
            if not isinstance(start, int):
                raise ExerciseError(f"resume: rank {r} returned {start}; return the steps "
                                    "done stored in the checkpoint, an int")
            if start == 0:
                raise ExerciseError(f"resume: rank {r} returned 0, so the run starts over "
                                    "and steps 0-3 count twice; return the checkpoint's "
                                    "steps_done (4 here)")
            if start == 6:
                raise ExerciseError(f"resume: rank {r} loaded step 6, which never completed "
                                    "(only rank 0 wrote it): trust directory / 'latest', "
                                    "which names the last step every rank wrote")
            if start != 4:
                raise ExerciseError(f"resume: rank {r} returned {start}; the latest complete "
                                    "checkpoint is after step 4")
            if not p["model"]:
                raise ExerciseError(f"resume: rank {r}'s model is not the checkpoint's: "
                                    "model.load_state_dict(state['model'])")
            if not p["momentum"]:
                raise ExerciseError(f"resume: rank {r}'s optimizer lost its momentum "
                                    "buffers; restore them too: "
                                    "optimizer.load_state_dict(state['optimizer'])")
        resumed = run_on_ranks("resume", train_resumable, 3, _model, _batches(), _mse, LR,
                               directory, EVERY, 0.9, None, resume)
        fresh = launch(train_resumable, 3, _model, _batches(), _mse, LR, directory / "fresh",
                       EVERY, backend="gloo", timeout=30)
        for r, ((_, got), (_, want)) in enumerate(zip(resumed, fresh, strict=True)):
            if not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
                raise ExerciseError(f"resume: after resuming, rank {r}'s final weights differ "
                                    "from an uninterrupted run's")
    return ("resume: a run killed after step 4 restarts on 3 ranks from the complete "
            "checkpoint (not the half-written step 6), momentum included, and ends where an "
            "uninterrupted run ends")
