"""A core lesson fits a 90-minute class, and what goes further lives in deep dives.

The limits (issue 42, from two reviews that timed the lessons): at most 3,300 words of
markdown, counted as `re.findall(r"\\w+", text)` over the markdown cells, and at most 45
cells. Every lesson opens with its time and learning goals. A deep dive (`deep_dives/
NNx_name.ipynb`) names the lesson it goes with, links back to it, and is linked from it;
every link between the course's notebooks resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minipar.lessons import deep_dive_notebooks, lesson_notebooks

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
MAX_WORDS, MAX_CELLS = 3300, 45
CORE = lesson_notebooks(LESSONS)
DEEP = deep_dive_notebooks(LESSONS)
# a markdown link to a notebook: [text](path.ipynb) or (path.ipynb#anchor)
NOTEBOOK_LINK = re.compile(r"\]\(([^)\s]+\.ipynb)(?:#[^)]*)?\)")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _markdown(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "markdown")


def test_there_are_twelve_core_lessons_and_deep_dives_beside_them():
    assert [p.name[:2] for p in CORE] == [f"{n:02}" for n in range(12)]
    assert DEEP, "no deep dives in lessons/deep_dives"


@pytest.mark.parametrize("lesson", CORE, ids=lambda p: p.stem)
def test_a_core_lesson_fits_a_90_minute_class(lesson):
    words = len(re.findall(r"\w+", _markdown(lesson)))
    cells = len(_cells(lesson))
    assert words <= MAX_WORDS and cells <= MAX_CELLS, (
        f"{lesson.name}: {words} words of markdown (at most {MAX_WORDS}) in {cells} cells "
        f"(at most {MAX_CELLS}); move a section to a deep dive in lessons/deep_dives")


@pytest.mark.parametrize("lesson", CORE, ids=lambda p: p.stem)
def test_a_lesson_opens_with_its_time_and_learning_goals(lesson):
    opening = "".join(_cells(lesson)[0]["source"])
    assert "**Time:**" in opening and "90-minute class" in opening, lesson.name
    assert "**Learning goals.**" in opening, lesson.name


@pytest.mark.parametrize("dive", DEEP, ids=lambda p: p.stem)
def test_a_deep_dive_goes_with_its_lesson_both_ways(dive):
    lesson = next((p for p in CORE if p.name[:2] == dive.name[:2]), None)
    assert lesson is not None, f"{dive.name} names lesson {dive.name[:2]}, which does not exist"
    title = "".join(_cells(dive)[0]["source"]).splitlines()[0]
    assert title.startswith(f"# {dive.name[:3]} · Deep dive: "), title
    assert f"](../{lesson.name})" in _markdown(dive), f"{dive.name} does not link to {lesson.name}"
    assert f"](deep_dives/{dive.name})" in _markdown(lesson), (
        f"{lesson.name} does not link to its deep dive {dive.name}")


@pytest.mark.parametrize("notebook", CORE + DEEP, ids=lambda p: p.stem)
def test_every_link_to_another_notebook_resolves(notebook):
    broken = [link for link in NOTEBOOK_LINK.findall(_markdown(notebook))
              if not (notebook.parent / link).resolve().is_file()]
    assert not broken, f"{notebook.name} links to notebooks that are not there: {broken}"
