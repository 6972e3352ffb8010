"""The README and the docs pages: the README stays one screen long, every link resolves, and
every shell or Python block they show is accounted for. A block is one of:
- run here, as a reader would type it (`<!-- run -->` before it; a page's blocks run in
  order, in one folder);
- run by a named test (`<!-- tested by tests/FILE.py::NAME -->`);
- an illustration, with the reason it is not run (`<!-- illustration: WHY -->`);
- the quickstart, which .ci/run itself runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(bash|sh|python|console)\s*$")
MARK = re.compile(r"^<!-- (run|tested by (\S+)::(\w+)|illustration: (.+)|quickstart:begin) -->$")


def blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, marker line before it, code) for every shell or Python block."""
    lines, found = page.read_text().split("\n"), []
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if match:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append((i + 1, match.group(1), lines[i - 1] if i else "",
                          "\n".join(lines[i + 1:end])))
    return found


def test_the_readme_is_one_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move sections into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_run_tested_or_said_to_be_an_illustration(page):
    for line, _, marker, _ in blocks(page):
        where = f"{page.name}:{line}"
        match = MARK.match(marker)
        assert match, (f"{where}: put <!-- run -->, <!-- tested by tests/FILE.py::NAME --> or "
                       "<!-- illustration: WHY --> on the line before the block")
        if match.group(2):
            test_file = ROOT / match.group(2)
            assert test_file.is_file(), f"{where}: {match.group(2)} does not exist"
            assert f"def {match.group(3)}(" in test_file.read_text(), \
                f"{where}: {match.group(2)} has no test {match.group(3)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"[a-z]+://|mailto:", target):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


RUN = [(page, line) for page in PAGES for line, _, marker, _ in blocks(page)
       if marker == "<!-- run -->"]


@pytest.mark.slow  # runs every docs page's commands
@pytest.mark.parametrize("page", sorted({page for page, _ in RUN}), ids=lambda p: p.name)
def test_the_blocks_marked_run_run(page, tmp_path):
    """In a folder of their own, with `.venv` this environment, in order (a page's later
    block may read what an earlier one wrote)."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "MPLBACKEND": "Agg"}
    for line, language, marker, code in blocks(page):
        if marker != "<!-- run -->":
            continue
        if language == "python":
            args = [sys.executable, "-c", code]
        else:
            args = ["bash", "-euo", "pipefail", "-c", code]
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True,
                              timeout=400, env=env)
        assert done.returncode == 0, (f"{page.name}:{line}", done.stdout[-2000:],
                                      done.stderr[-3000:])
        assert "Traceback" not in done.stderr, (f"{page.name}:{line}", done.stderr[-3000:])
