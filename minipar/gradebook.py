"""Grading a class: `minipar grade SUBMISSIONS --lesson NN`.

Each learner's copy of lesson NN is executed on its own, in a scratch folder, with a time
limit. Every exercise check the lesson calls (a cell `print(check_NAME(NAME))`) is
recorded as "pass" or as the hint the check raised. The hint names the rank and step
where the answer went wrong. Whatever else goes wrong is one line in the gradebook, and
the batch goes on:
- a notebook that hangs past the limit;
- a kernel that dies;
- an empty or unreadable file;
- a syntax error;
- a function never defined;
- a notebook that deletes files (it runs on a copy, alone).

SUBMISSIONS holds one notebook per learner: `NAME.ipynb`, or `NAME/.../NN_*.ipynb`, which
is nbgrader's `submitted/NAME/ASSIGNMENT/` layout. The gradebook is `gradebook.csv`: one
row per learner, one column per check, a score, and a note. Ranks a notebook starts are
children of its kernel, and they end with it (runtime/worker.py: `_die_with_parent`).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .lessons import BEGIN, lesson_notebooks, read_lesson
from .report import format_table

CHECK_CALL = re.compile(r"\bcheck_(\w+)\(")  # a check cell: print(check_ring_all_reduce(...))


def lesson_checks(nb: dict) -> list[str]:
    """The exercise checks a lesson notebook calls, in order (the checked exercise's name)."""
    names = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            names += [n for n in CHECK_CALL.findall("".join(cell.get("source", "")))
                      if n not in names]
    return names


def nbgrader_marked(nb: dict) -> dict:
    """The notebook with the cell metadata nbgrader's `generate_assignment` reads: each
    solution cell (### BEGIN SOLUTION, nbgrader's own markers) an "autograded answer",
    each check cell a locked "autograder test" worth one point. minipar's own tools ignore it."""
    out = json.loads(json.dumps(nb))
    for i, cell in enumerate(out.get("cells", [])):
        source = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code":
            continue
        check = CHECK_CALL.search(source)
        if BEGIN in source:
            name = re.search(r"def (\w+)\(", source)
            meta = {"grade": False, "solution": True, "locked": False,
                    "grade_id": name.group(1) if name else f"cell{i}"}
        elif check:
            meta = {"grade": True, "solution": False, "locked": True, "points": 1,
                    "grade_id": f"check_{check.group(1)}"}
        else:
            continue
        cell.setdefault("metadata", {})["nbgrader"] = {**meta, "schema_version": 3,
                                                       "task": False}
    return out


@dataclass
class Grade:
    """One learner's row: each check's "pass" or hint, and a note on the notebook."""

    learner: str
    results: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def score(self, checks: list[str]) -> int:
        return sum(self.results.get(name) == "pass" for name in checks)


def _one_line(text: str, limit: int = 300) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # tracebacks' colours
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_results(executed: dict, checks: list[str]) -> tuple[dict[str, str], str]:
    """Each check's outcome in an executed notebook, and the first error outside them."""
    results, first_error = {}, ""
    for i, cell in enumerate(executed.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        called = [n for n in CHECK_CALL.findall("".join(cell.get("source", ""))) if n in checks]
        ran = cell.get("execution_count") is not None or bool(cell.get("outputs"))
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        error = ""
        if errors:  # a check's own hint reads best alone; any other error says its kind
            ename, evalue = errors[0].get("ename", ""), errors[0].get("evalue", "")
            error = evalue if ename == "ExerciseError" else f"{ename}: {evalue}"
        for name in called:
            if name not in results and ran:
                results[name] = f"fail: {_one_line(error)}" if error else "pass"
        if error and not called and not first_error:
            first_error = f"cell {i}: {_one_line(error, 200)}"
    return results, first_error


# Runs in a process of its own: a notebook that hangs or kills its kernel ends that process,
# never the grader. Partial results are written as cells finish, whatever stops the run.
_RUNNER = """
import json, sys, time, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
path, out, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
nb = nbformat.read(path, as_version=4)
deadline = time.monotonic() + limit  # the whole notebook's limit: each cell gets what is left
client = NotebookClient(nb, timeout_func=lambda cell: max(1, deadline - time.monotonic()),
                        allow_errors=True, kernel_name="python3",
                        resources={"metadata": {"path": sys.argv[4]}})
stop = ""
try:
    client.execute()
except CellTimeoutError:
    stop = f"the notebook ran past its {limit:g} s limit (an endless loop?)"
except DeadKernelError:
    stop = "the kernel died (os._exit, a crash or out of memory)"
except Exception as err:
    stop = f"{type(err).__name__}: {err}"
nbformat.write(nb, out)
json.dump({"stop": stop}, open(out + ".stop", "w"))
"""


def grade_notebook(path: Path, checks: list[str], learner: str, limit: float) -> Grade:
    """Run one submission in a scratch folder of its own and read its checks."""
    grade = Grade(learner, {name: "not run" for name in checks})
    try:
        nb = read_lesson(path)
    except ValueError as err:  # its message's first part: what is wrong with the file
        empty = path.stat().st_size == 0
        grade.note = "the file is empty" if empty else _one_line(str(err).split(";")[0], 200)
        return grade
    if not nb.get("cells"):
        grade.note = "the notebook has no cells"
        return grade
    with tempfile.TemporaryDirectory(prefix="minipar-grade-") as scratch:
        work = Path(scratch) / "work"
        work.mkdir()
        copy = work / path.name
        shutil.copy2(path, copy)
        out = Path(scratch) / "executed.ipynb"  # outside work/: the notebook cannot delete it
        env = {**os.environ, "MINIPAR_OUT": str(Path(scratch) / "out"),
               "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            subprocess.run([sys.executable, "-c", _RUNNER, str(copy), str(out), str(limit),
                            str(work)], cwd=work, env=env, capture_output=True,
                           timeout=limit + 60, start_new_session=True)
        except subprocess.TimeoutExpired:
            grade.note = f"stopped after {limit + 60:g} s"
        if not out.exists():
            grade.note = grade.note or "the notebook could not be run"
            return grade
        results, first_error = read_results(json.loads(out.read_text()), checks)
        grade.results.update(results)  # the checks never reached stay "not run"
        grade.note = json.loads(Path(str(out) + ".stop").read_text())["stop"] or first_error
    return grade


def find_submissions(folder: Path, lesson: str) -> dict[str, Path | None]:
    """{learner: their notebook of the lesson (None: nothing submitted)} in `folder`."""
    found: dict[str, Path | None] = {}
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.suffix == ".ipynb":
            found[entry.stem] = entry
        elif entry.is_dir() and not entry.name.startswith("."):
            mine = sorted(entry.rglob(f"{lesson}_*.ipynb"))
            found[entry.name] = mine[0] if mine else None
    return found


def grade_class(submissions: str | Path, lesson: str, lessons_dir: str | Path,
                limit: float = 600, out: str | Path | None = None) -> tuple[list[str], list[Grade]]:
    """Grade every submission of lesson `lesson` ("01") in `submissions`; write
    gradebook.csv into `out` (default: the submissions folder); the checks and grades."""
    submissions = Path(submissions)
    if not submissions.is_dir():
        raise ValueError(f"{submissions} is not a folder; name the folder of submitted "
                         "notebooks")
    shipped = [p for p in lesson_notebooks(lessons_dir) if p.name.startswith(f"{lesson}_")]
    if not shipped:
        raise ValueError(f"--lesson {lesson}: no lesson {lesson}_*.ipynb in {lessons_dir}; "
                         "use a two-digit number, e.g. --lesson 01")
    checks = lesson_checks(read_lesson(shipped[0]))
    if not checks:
        raise ValueError(f"lesson {shipped[0].name} has no exercise checks to grade")
    grades = []
    for learner, path in find_submissions(submissions, lesson).items():
        print(f"  .. {learner}", flush=True)
        if path is None:
            grades.append(Grade(learner, {n: "not submitted" for n in checks},
                                f"no {lesson}_*.ipynb in {learner}/"))
        else:
            grades.append(grade_notebook(path, checks, learner, limit))
    if not grades:
        raise ValueError(f"{submissions} holds no submissions (NAME.ipynb or NAME/ folders)")
    book = Path(out) if out is not None else submissions
    book.mkdir(parents=True, exist_ok=True)
    with open(book / "gradebook.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", "score", *checks, "note"])
        for g in grades:
            writer.writerow([g.learner, f"{g.score(checks)}/{len(checks)}",
                             *(g.results.get(n, "") for n in checks), g.note])
    return checks, grades


def summary(checks: list[str], grades: list[Grade]) -> str:
    """A table: each learner's score and what went wrong first."""
    rows = [{"learner": g.learner, "score": f"{g.score(checks)}/{len(checks)}",
             "problem": _one_line(g.note or next(
                 (f"{n}: {r}" for n, r in g.results.items() if r != "pass"), ""), 90)}
            for g in grades]
    return format_table(rows, [("learner", "learner"), ("score", "score"),
                               ("problem", "first problem")])
