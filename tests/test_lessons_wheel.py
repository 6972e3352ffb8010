"""`pip install minipar` gives the course: a wheel built from this tree, installed in a fresh
virtual environment, writes the instructor's and the learners' copies of the lessons,
runs the tour's smallest rows, and teaches lesson 00 under nbval, all from the installed
copy (never this checkout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ONLY = ("minipar", "__editable__")  # this checkout's own install: not for the new venv


def _tree(dest: Path) -> Path:
    """This working tree's files (tracked, and new ones git does not ignore), copied: the
    wheel is built from them, never from a build/ folder an earlier build left."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def fresh_venv(where: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch, jupyter, nbval) but
    not minipar: torch is not installed again (a bare `torch` pulls a multi-GB CUDA build)."""
    venv.create(where, with_pip=False)
    shared = where / "shared"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(SOURCE_ONLY):
            (shared / entry.name).symlink_to(entry)
    python = where / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    Path(purelib.stdout.strip(), "shared.pth").write_text(f"{shared}\n")
    return python


def _run(args: list, cwd: Path, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


@pytest.mark.slow  # builds a wheel, installs it in a venv, runs a lesson
def test_an_installed_wheel_carries_and_teaches_the_lessons(tmp_path):
    src = _tree(tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", tmp_path / "dist", src], cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("minipar-*.whl"))
    python = fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "-q", wheel], cwd=tmp_path)
    where = _run([python, "-c", "import minipar; print(minipar.__file__)"], cwd=tmp_path)
    assert where.startswith(str(tmp_path / "venv")), where  # the installed copy, not ours
    minipar = tmp_path / "venv" / "bin" / "minipar"

    tour = _run([minipar, "tour", "--only", "basics,collectives", "--out", "tour"], tmp_path)
    assert "exact techniques match one process" in tour and " 0/" not in tour

    _run([minipar, "lessons", "--copy", "course"], cwd=tmp_path)
    shipped = sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in (tmp_path / "course").glob("*.ipynb")) == shipped
    dives = sorted(p.name for p in (ROOT / "lessons" / "deep_dives").glob("*.ipynb"))
    assert sorted(p.name for p in (tmp_path / "course" / "deep_dives").glob("*.ipynb")) == dives
    assert (tmp_path / "course" / "sanitize.cfg").is_file()

    _run([minipar, "lessons", "--student", "student"], cwd=tmp_path)
    learner = json.loads((tmp_path / "student" / "01_collectives.ipynb").read_text())
    code = "".join("".join(c["source"]) for c in learner["cells"] if c["cell_type"] == "code")
    assert "NotImplementedError" in code and "### BEGIN SOLUTION" not in code

    # lesson 00 from the installed copy, as CI runs the lessons (in a folder of its own:
    # this checkout's pytest settings do not apply)
    out = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                "--nbval-current-env", "--nbval-sanitize-with", "course/sanitize.cfg",
                "course/00_why_parallel.ipynb"], cwd=tmp_path, timeout=600)
    assert " passed" in out and "failed" not in out, out[-2000:]
