"""Every number a lesson's prose states is computed by one of its cells, or cited.

Issue 42: the reviews found the lessons' errors exactly where nothing checked them,
in hand-derived answers and in figures typed into prose. This test reads every numeral
in a core lesson's markdown and looks for it among the numbers its code cells print or
use. A numeral is explained when some such number rounds to it, in the prose's own
precision ("121.7" is explained by 121.65), at any power-of-1000 scale or as a percent
(a cell's 1.05e7 s and the prose's "10.5 million", a fraction 0.44 and "44%"). What no
cell computes must be a figure the lesson quotes from a source named in
`lessons/cited_figures.md`.

Not numerals for this test: lesson, section and problem numbers, issue numbers
(torchtitan#2318), years, the opening "Time" line, code in backticks, link targets, and
one-digit counts ("2 ranks", "0.5"). A multiplier is a numeral: "1.75x" is 1.75."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minipar.lessons import lesson_notebooks
from minipar.worked import rounds_to

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
CORE = lesson_notebooks(LESSONS)


def _cited() -> dict[str, dict[str, str]]:
    """lessons/cited_figures.md's table: lesson -> figure (no thousands commas) -> source."""
    cited: dict[str, dict[str, str]] = {}
    for line in (LESSONS / "cited_figures.md").read_text().splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) == 3 and re.fullmatch(r"\d\d|all", cols[0]):
            cited.setdefault(cols[0], {})[cols[1].replace(",", "")] = cols[2]
    return cited


CITED = _cited()
# a numeral: digits, thousands commas, decimals, an optional exponent (8.4e22)
NUMERAL = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][+-]?\d+)?(?![^\Wx]|x\w)")
# LaTeX scientific notation, $2.25\times10^{15}$, read as 2.25e15
LATEX_POWER = re.compile(r"(\d+(?:\.\d+)?)\s*\\times\s*10\^\{?(-?\d+)\}?")
REFERENCE = re.compile(
    r"(?i)\b(lessons?|deep dives?|sections?|problems?|parts?|notebooks?)\s+"
    r"((?:\d{1,2}[a-z]?(?:\s*(?:,|and|or|-|–|to)\s*)?)+)")
SCALES = [1000.0 ** k for k in range(-5, 6)] + [100.0, 0.01]


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _output_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        for kind, data in out.get("data", {}).items():
            if kind in ("text/plain", "text/markdown", "text/html"):
                parts.append("".join(data) if isinstance(data, list) else str(data))
    return "\n".join(parts)


def _values(text: str) -> list[float]:
    text = LATEX_POWER.sub(r"\1e\2", text)
    return [float((m[1] + (m[2] or "") + (m[3] or "")).replace(",", ""))
            for m in NUMERAL.finditer(text)]


def _prose(source: str) -> str:
    """The markdown a reader reads as claims: references, code and links removed."""
    source = re.sub(r"\]\([^)]*\)", "]", source)  # link targets
    source = re.sub(r"\[\d\d[a-z]?\b[^\]]*\]", "", source)  # [04 · Tensor parallelism]
    source = re.sub(r"`[^`]*`", "", source)
    source = re.sub(r"\*\*Time:\*\*[^\n]*", "", source)
    source = re.sub(r"[\w/-]+#\d+", "", source)  # an issue or pull request: torchtitan#2318
    source = REFERENCE.sub("", source)
    return LATEX_POWER.sub(r"\1e\2", source)


def _is_a_claim(figure: str) -> bool:
    digits = re.sub(r"[^\d]", "", figure.split("e")[0].split("E")[0]).lstrip("0")
    if len(digits) <= 1:
        return False  # "2 ranks", "0.5": counts and toy values, not measurements
    return not re.fullmatch(r"(19|20)\d\d", figure)  # a year


def _explained(figure: str, computed: list[float]) -> bool:
    return any(rounds_to(abs(v) * s, figure) for v in computed for s in SCALES)


def unexplained(path: Path) -> list[str]:
    """Each numeral of the lesson's prose that no cell computes and no source is cited for,
    as 'cell N: figure | the words around it'."""
    cells = _cells(path)
    computed = _values("\n".join("".join(c["source"]) + "\n" + _output_text(c)
                                 for c in cells if c["cell_type"] == "code"))
    cited = set(CITED.get(path.name[:2], {})) | set(CITED.get("all", {}))
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        prose = _prose("".join(cell["source"]))
        for m in NUMERAL.finditer(prose):
            figure = m[0]
            if not _is_a_claim(figure) or figure.replace(",", "") in cited:
                continue
            if not _explained(figure, computed):
                around = prose[max(0, m.start() - 50):m.end() + 30].replace("\n", " ")
                found.append(f"cell {index}: {figure} | {around}")
    return found


@pytest.mark.parametrize("lesson", CORE, ids=lambda p: p.stem)
@pytest.mark.slow  # reads every lesson's cells and outputs
def test_every_numeral_a_lesson_states_is_computed_or_cited(lesson):
    found = unexplained(lesson)
    assert not found, (
        f"{lesson.name}: {len(found)} numerals no cell computes and no source is cited for "
        f"(compute them in a cell, hold worked answers with minipar.worked.held, or cite "
        f"the source in lessons/cited_figures.md):\n  " + "\n  ".join(found))


def test_every_cited_figure_is_still_in_its_lesson():
    prose = {p.name[:2]: _prose("\n".join("".join(c["source"]) for c in _cells(p)
                                          if c["cell_type"] == "markdown")) for p in CORE}
    for lesson, figures in CITED.items():
        texts = list(prose.values()) if lesson == "all" else [prose[lesson]]
        for figure, source in figures.items():
            assert source, f"cited_figures.md, lesson {lesson}, {figure}: name its source"
            assert any(figure in [m[0].replace(",", "") for m in NUMERAL.finditer(t)]
                       for t in texts), (
                f"cited_figures.md: lesson {lesson} no longer states {figure}; remove the row")


if __name__ == "__main__":  # python tests/test_lessons_numerals.py 03: what lesson 03 lacks
    import sys
    for path in CORE:
        if len(sys.argv) < 2 or path.name.startswith(sys.argv[1]):
            found = unexplained(path)
            print(f"{path.stem}: {len(found)}")
            for line in found:
                print("  " + line)
