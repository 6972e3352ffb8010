"""The browser half of the drawn widgets: each view's ES module is the shared helpers
(common.js) followed by the view's own file, joined here so there is no build step."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def esm(name: str) -> str:
    """The ES module anywidget loads for the view in `name` (e.g. "gantt.js")."""
    return (HERE / "common.js").read_text() + "\n" + (HERE / name).read_text()
