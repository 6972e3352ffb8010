"""Every benchmark's plot is saved by `report.save_results`, which puts a title on it; no
benchmark can leave the title out."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from minipar.bench import BENCHMARKS
from minipar.report import save_results


def _calls(module: str) -> list[ast.Call]:
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "save_results"]


def _reporting_module(name: str) -> str:
    """Where benchmark `name`'s report is written: its own module, or the one whose report
    it reuses (`bench train-dp` reuses `bench train`'s through functools.partial)."""
    report = importlib.import_module(BENCHMARKS[name]).report
    return getattr(report, "func", report).__module__


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_saves_its_plot_with_a_title(name):
    module = _reporting_module(name)
    calls = _calls(module)
    assert calls, f"{module} saves no plot through save_results"
    for call in calls:
        title = next((k.value for k in call.keywords if k.arg == "title"), None)
        assert isinstance(title, (ast.Constant, ast.JoinedStr)), \
            f"{module}:{call.lineno}: save_results without a written title="
        text = ast.unparse(title)
        assert len(text) > 12, f"a title that says what is compared, not {text}"


def test_save_results_titles_the_figure_and_refuses_an_empty_title(tmp_path):
    fig = Figure()
    fig.add_subplot().plot([1, 2], [3, 4])
    save_results([{"x": 1}], fig, tmp_path, "demo", title="x against y, measured")
    assert fig.get_suptitle() == "x against y, measured"
    assert json.loads((tmp_path / "bench_demo.json").read_text()) == [{"x": 1}]
    assert (tmp_path / "bench_demo.png").stat().st_size > 0
    with pytest.raises(ValueError, match="title must say what the plot compares"):
        save_results([], Figure(), tmp_path, "empty", title=" ")
