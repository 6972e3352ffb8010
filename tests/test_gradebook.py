"""`minipar grade` on a folder of generated submissions of lesson 01: a right answer, a wrong
one (the hint names rank and step), a learner's untouched copy, and every way a notebook
can break (a hang, a dead kernel, an empty file, a syntax error, a notebook that deletes
its files, a function never defined, nothing submitted) each one line, the batch going on."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pytest

from minipar.__main__ import main
from minipar.gradebook import lesson_checks
from minipar.lessons import student_notebook

LESSON = Path(__file__).resolve().parents[1] / "lessons" / "01_collectives.ipynb"


def _cells(nb: dict, *needles: str) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"
            and any(n in "".join(c["source"]) for n in needles)]


def _code(source: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": source, "outputs": [],
            "execution_count": None}


def _submission(nb: dict, before_checks: list[str] = (), drop: str = "",
                replace: tuple[str, str] = ("", "")) -> dict:
    """Lesson 01's imports, its two solutions and their checks, as a learner hands them in:
    `before_checks` cells go before the checks, `drop` removes a solution, `replace` edits."""
    imports = _cells(nb, "from minipar.collectives.exercises import")[:1]
    solutions = _cells(nb, "def ring_all_reduce(", "def tree_broadcast(")
    solutions = [c for c in solutions if not drop or f"def {drop}(" not in "".join(c["source"])]
    checks = _cells(nb, "print(check_")
    cells = copy.deepcopy(imports + solutions) + [_code(s) for s in before_checks] + \
        copy.deepcopy(checks)
    for c in cells:
        c["source"] = "".join(c["source"]).replace(*replace) if replace[0] else c["source"]
        c["outputs"], c["execution_count"] = [], None
    return {**nb, "cells": cells}


# its own bound: one hanging notebook waits out LIMIT, nine others run about 6 s each
# unloaded (75 s in all), up to 3x that on a busy machine; each learner's limit leaves the
# same 3x margin over their notebook's time, so a busy machine never fails a right answer
LIMIT = 45


@pytest.mark.slow  # executes ten learners' notebooks, one hangs to its limit
@pytest.mark.timeout(LIMIT + 10 * 3 * 6 + 300)
def test_a_class_of_mixed_submissions_is_graded_one_line_each(tmp_path, capsys):
    nb = json.loads(LESSON.read_text())
    assert lesson_checks(nb) == ["ring_all_reduce", "tree_broadcast"]
    subs = tmp_path / "submitted"
    (subs / "ada" / "lesson01").mkdir(parents=True)  # nbgrader's submitted/NAME/ASSIGNMENT/
    write = {
        "ada/lesson01/01_collectives": _submission(nb),
        "bo": _submission(nb, replace=("for step in range(k - 1):\n        send_i, recv_i = "
                                       "(me + 1 - step)", "for step in range(0):\n        "
                                       "send_i, recv_i = (me + 1 - step)")),
        "cy": student_notebook(_submission(nb)),
        "dee": _submission(nb, before_checks=["while True:\n    pass"]),
        "eli": _submission(nb, before_checks=["import os\nos._exit(1)"]),
        "gus": _submission(nb, replace=("def ring_all_reduce(tensor: torch.Tensor) -> "
                                        "torch.Tensor:", "def ring_all_reduce(tensor) -> :")),
        "hal": _submission(nb, before_checks=[
            "from pathlib import Path\nfor p in Path('.').iterdir():\n    p.unlink()"]),
        "ivy": _submission(nb, drop="tree_broadcast"),
    }
    for name, content in write.items():
        (subs / f"{name}.ipynb").write_text(json.dumps(content))
    (subs / "fay.ipynb").write_text("")  # an empty file
    (subs / "jon").mkdir()  # a folder with nothing of lesson 01 in it
    assert main(["grade", str(subs), "--lesson", "1", "--limit", str(LIMIT),
                 "--out", str(tmp_path / "book")]) == 0
    rows = {r["learner"]: r for r in csv.DictReader(open(tmp_path / "book" / "gradebook.csv"))}
    assert sorted(rows) == ["ada", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jon"]
    assert rows["ada"]["score"] == "2/2" and rows["hal"]["score"] == "2/2"
    assert rows["bo"]["score"] == "1/2" and rows["bo"]["tree_broadcast"] == "pass"
    assert "rank" in rows["bo"]["ring_all_reduce"] and "step" in rows["bo"]["ring_all_reduce"]
    assert "not written yet" in rows["cy"]["ring_all_reduce"] and rows["cy"]["score"] == "0/2"
    assert f"its {LIMIT} s limit" in rows["dee"]["note"] and rows["dee"]["score"] == "0/2"
    assert "kernel died" in rows["eli"]["note"] and rows["eli"]["ring_all_reduce"] == "not run"
    assert rows["fay"]["note"] == "the file is empty" and rows["fay"]["score"] == "0/2"
    assert "SyntaxError" in rows["gus"]["note"] and "NameError" in rows["gus"]["ring_all_reduce"]
    assert rows["ivy"]["ring_all_reduce"] == "pass"
    assert "NameError: name 'tree_broadcast' is not defined" in rows["ivy"]["tree_broadcast"]
    assert rows["jon"]["ring_all_reduce"] == "not submitted" and "no 01_*.ipynb" in rows["jon"][
        "note"]
    for row in rows.values():  # one line each, whatever happened
        assert all("\n" not in value for value in row.values()), row
    table = capsys.readouterr().out
    assert "learner" in table and "ada      2/2" in table


def test_grade_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert main(["grade", str(tmp_path / "missing"), "--lesson", "01"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["grade", str(tmp_path), "--lesson", "42"]) == 2
    assert "no lesson 42_*.ipynb" in capsys.readouterr().err
    assert main(["grade", str(tmp_path), "--lesson", "01"]) == 2
    assert "holds no submissions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["grade", str(tmp_path), "--lesson", "one"])
    assert "expected a lesson number such as 01" in capsys.readouterr().err


LESSONS = sorted(LESSON.parent.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem[:2])
def test_every_lesson_carries_the_metadata_nbgrader_reads(path):
    """Each solution cell an autograded answer, each check cell a locked test worth a point
    (`nbgrader_marked` leaves a marked lesson as it is)."""
    from minipar.gradebook import nbgrader_marked

    nb = json.loads(path.read_text())
    assert nbgrader_marked(nb) == nb, f"{path.name}: run gradebook.nbgrader_marked over it"
    marked = [c["metadata"]["nbgrader"] for c in nb["cells"] if "nbgrader" in c["metadata"]]
    assert sum(m["solution"] for m in marked) == len(lesson_checks(nb)) == \
        sum(m["grade"] for m in marked) >= 2


@pytest.mark.slow  # runs nbgrader in a subprocess
def test_nbgrader_generate_assignment_accepts_a_lesson(tmp_path):
    """In a venv of its own (nbgrader brings the notebook package, whose lab extension
    breaks Voila's pages in the environment it shares): installed from the registry, or
    skipped, saying so, where there is none."""
    import os
    import subprocess
    import sys

    from test_lessons_wheel import fresh_venv

    python = fresh_venv(tmp_path / "venv")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    got = subprocess.run([*pip, "nbgrader>=0.9"], capture_output=True, text=True, timeout=400)
    if not got.returncode:  # nbgrader runs the `alembic` script: its own venv's, never ours
        got = subprocess.run([*pip, "--no-deps", "--ignore-installed", "alembic"],
                             capture_output=True, text=True, timeout=400)
    if got.returncode:
        pytest.skip(f"nbgrader did not install: {got.stderr.strip().splitlines()[-1:]}")
    source = tmp_path / "course" / "source" / "lesson01"
    source.mkdir(parents=True)
    (source / LESSON.name).write_text(LESSON.read_text())
    course = tmp_path / "course"
    bin_dir = str(python.parent)
    done = subprocess.run([str(python), "-m", "nbgrader", "generate_assignment", "lesson01",
                           f"--CourseDirectory.root={course}", "--force"], cwd=course,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    released = json.loads((course / "release" / "lesson01" / LESSON.name).read_text())
    code = ["".join(c["source"]) for c in released["cells"] if c["cell_type"] == "code"]
    assert not any("### BEGIN SOLUTION" in c for c in code)
    stubbed = [c for c in code if "def ring_all_reduce(" in c or "def tree_broadcast(" in c]
    assert len(stubbed) == 2 and all("raise NotImplementedError" in c for c in stubbed)
    assert any("print(check_ring_all_reduce(ring_all_reduce))" in c for c in code)
