"""Learners' copies of the lessons.

A lesson's exercise is a function whose body sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION``. `minipar lessons --student DIR` writes copies where that part
is replaced by a stub raising NotImplementedError that names the exercise, with
every output cleared. The checks that grade the exercises live with their
technique (`minipar.<technique>.exercises`).

Beside the twelve core lessons, each one a 90-minute class, `deep_dives/` holds the
notebooks that go further (the research systems, the extra measurements, the second
variants): `NNx_name.ipynb` goes with lesson NN, links back to it and runs on its own.
They travel wherever the lessons do: student copies and the offline site.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
DEEP_DIVES = "deep_dives"  # the deep dives' folder, inside the lessons folder


def strip_solutions(source: str, cell_label: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION block with a stub naming its exercise."""
    lines, out, inside = source.split("\n"), [], False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError(f"{cell_label}: {BEGIN} inside another solution block")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            name = _exercise_name(lines[:i], indent) or cell_label
            out.append(f'{indent}raise NotImplementedError("exercise {name}: '
                       'write your code here")')
        elif stripped.startswith(END):
            if not inside:
                raise ValueError(f"{cell_label}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{cell_label}: {BEGIN} without {END}")
    return "\n".join(out)


def _exercise_name(before: list[str], indent: str) -> str | None:
    """The innermost enclosing `def` above the solution block."""
    for line in reversed(before):
        match = re.match(r"(\s*)def (\w+)", line)
        if match and len(match.group(1)) < len(indent):
            return match.group(2)
    return None


def without_test_markers(source: str) -> str:
    """A code cell's source without the `# NBVAL_*` lines that only the tests read."""
    return "\n".join(line for line in source.split("\n")
                     if not line.strip().startswith("# NBVAL_"))


def student_notebook(notebook: dict) -> dict:
    """A learner's copy of a notebook: solutions stubbed, every output and the saved
    widget state cleared, and the test-only `# NBVAL_*` marker lines dropped."""
    copy = json.loads(json.dumps(notebook))
    copy.get("metadata", {}).pop("widgets", None)
    for index, cell in enumerate(copy["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if BEGIN in source:
            source = strip_solutions(source, f"cell {index}")
        cell["source"] = without_test_markers(source).splitlines(keepends=True)
        cell["outputs"], cell["execution_count"] = [], None
    return copy


def read_lesson(path: Path) -> dict:
    """A lesson notebook's JSON; a ValueError naming the file unless it is UTF-8 JSON with
    a list of cells (a binary file or another JSON file is refused before anything runs)."""
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a notebook ({type(err).__name__} at byte "
                         f"{getattr(err, 'start', getattr(err, 'pos', '?'))}); remove it from "
                         "the lessons folder or restore it (git checkout)") from None
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise ValueError(f"{path} is JSON but not a notebook (no list of cells); remove it "
                         "from the lessons folder or restore it (git checkout)")
    return notebook


def lesson_notebooks(source_dir: str | Path) -> list[Path]:
    """The lessons (NN_name.ipynb) in `source_dir`, in order, each checked to be a
    notebook; a ValueError if there are none or one is not."""
    notebooks = sorted(Path(source_dir).glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise ValueError(f"no lesson notebooks (NN_name.ipynb) in {source_dir}; "
                         "pass --source with the lessons folder of a minipar checkout")
    for path in notebooks:
        read_lesson(path)
    return notebooks


def deep_dive_notebooks(source_dir: str | Path) -> list[Path]:
    """The deep dives (NNx_name.ipynb, going with lesson NN) in `source_dir`/deep_dives, in
    order, each checked to be a notebook; none is not an error."""
    notebooks = sorted((Path(source_dir) / DEEP_DIVES).glob("[0-9][0-9][a-z]_*.ipynb"))
    for path in notebooks:
        read_lesson(path)
    return notebooks


def folder_to_write(path: Path, option: str) -> None:
    """Refuse an output folder that is a file, naming the command-line option."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file; name a folder (new or existing)")


# what the notebooks read beside them: nbval's output sanitizer, the cited figures' sources
BESIDE = ("sanitize.cfg", "cited_figures.md")


def write_instructor_copies(source_dir: str | Path, dest_dir: str | Path, force: bool = False
                            ) -> tuple[list[Path], list[Path]]:
    """Copy every lesson and deep dive as it ships (solutions and saved outputs kept) and the
    files they read into `dest_dir`, e.g. from an installed wheel to teach from. Notebooks
    already there are kept unless `force`. Returns the paths written and the paths kept."""
    source_dir, dest_dir = Path(source_dir), Path(dest_dir)
    notebooks = lesson_notebooks(source_dir) + deep_dive_notebooks(source_dir)
    folder_to_write(dest_dir, "--copy")
    if dest_dir.resolve() == source_dir.resolve():
        raise ValueError("--copy must name another folder than the lessons folder")
    written, kept = [], []
    for path in notebooks + [source_dir / name for name in BESIDE]:
        target = dest_dir / path.relative_to(source_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and not force and target.suffix == ".ipynb":
            kept.append(target)
            continue
        if path.is_file():
            target.write_bytes(path.read_bytes())
            written.append(target)
    return written, kept


def write_student_copies(source_dir: str | Path, dest_dir: str | Path, force: bool = False
                         ) -> tuple[list[Path], list[Path]]:
    """Write a learner's copy of every lesson notebook in `source_dir` into `dest_dir`,
    and of every deep dive into `dest_dir`/deep_dives (so the lessons' links to them hold).
    A notebook already there is a learner's work: it is kept unless `force`. Returns the
    paths written and the paths kept."""
    source_dir, dest_dir = Path(source_dir), Path(dest_dir)
    notebooks = lesson_notebooks(source_dir) + deep_dive_notebooks(source_dir)
    folder_to_write(dest_dir, "--student")
    if dest_dir.resolve() == source_dir.resolve():
        raise ValueError("the student folder must differ from the lessons folder, "
                         "or the solutions would be overwritten")
    dest_dir.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for path in notebooks:
        target = dest_dir / path.relative_to(source_dir)
        target.parent.mkdir(exist_ok=True)
        if target.exists() and not force:
            kept.append(target)
            continue
        copy = student_notebook(read_lesson(path))
        target.write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written, kept
