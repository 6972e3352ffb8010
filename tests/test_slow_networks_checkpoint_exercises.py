"""Lesson 10's resume check: the right answer passes; starting over, trusting the newest
folder, forgetting the optimizer and reading a file that does not exist get hints."""

from pathlib import Path

import pytest
import torch

from minipar.grading import ExerciseError
from minipar.runtime import rank
from minipar.slow_networks.checkpoint_restart import load_checkpoint
from minipar.slow_networks.exercises import check_resume

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
# slow: each check trains, kills and resumes a run
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("faked_device_on")]


def right(directory, model, optimizer):
    marker = Path(directory) / "latest"
    if not marker.exists():
        return 0
    step = int(marker.read_text())
    folder = Path(directory) / f"step-{step}"
    mine = folder / f"rank-{rank()}.pt"
    state = torch.load(mine if mine.exists() else folder / "rank-0.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["steps_done"]


def starts_over(directory, model, optimizer):
    return 0


def newest_folder(directory, model, optimizer):
    folders = sorted(Path(directory).glob("step-*"), key=lambda f: int(f.name[5:]))
    state = torch.load(folders[-1] / "rank-0.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["steps_done"]


def model_only(directory, model, optimizer):
    step = int((Path(directory) / "latest").read_text())
    state = torch.load(Path(directory) / f"step-{step}" / "rank-0.pt", weights_only=True)
    model.load_state_dict(state["model"])
    return state["steps_done"]


def own_file_only(directory, model, optimizer):
    step = int((Path(directory) / "latest").read_text())
    state = torch.load(Path(directory) / f"step-{step}" / f"rank-{rank()}.pt",
                       weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["steps_done"]


def test_the_right_resume_passes():
    assert "ends where an uninterrupted run ends" in check_resume(right)


@pytest.mark.parametrize("wrong,words", [
    (starts_over, "returned 0, so the run starts over"),
    (newest_folder, "loaded step 6, which never completed"),
    (model_only, "lost its momentum buffers"),
    (own_file_only, "read rank 0's file when yours does not exist"),
])
def test_usual_mistakes_get_hints(wrong, words):
    with pytest.raises(ExerciseError, match=words):
        check_resume(wrong)


def test_the_library_is_refused():
    with pytest.raises(ExerciseError, match="library's own implementation"):
        check_resume(load_checkpoint)
