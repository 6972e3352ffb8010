"""The offline site's pages load every script from the site itself (the browser test in
tests/browser/test_offline_site.py opens them with the network refused)."""

from __future__ import annotations

import re
import subprocess
import sys

import nbformat
import pytest

from minipar.lesson_site import build_site, lesson_page, site_links


def _notebook():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 99 · A test lesson\n\nOne formula: $2\\times3$."),
        nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nprint(6)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {}, "version_major": 2, "version_minor": 0}}  # saved widgets: a manager
    return nb


def test_a_page_loads_its_scripts_from_the_site_only():
    page = lesson_page(_notebook())
    sources = re.findall(r'<script[^>]*\bsrc="([^"]+)"', page)
    assert set(sources) == {"static/require.js", "static/tex-svg.js"}  # + the manager:
    assert "var widgetRendererSrc = 'static/embed-amd.js'" in page
    assert 'anywidget: "static/anywidget"' in page  # never a CDN for anywidget's module
    remote = re.findall(r"https?://[^\"')\s]+\.m?js", page)
    # nbconvert imports mermaid from a CDN only on pages with mermaid diagrams (none here)
    assert remote and all("mermaid" in url for url in remote), remote
    assert "<title>minipar: 99 · A test lesson</title>" in page
    assert "NBVAL" not in page  # the tests' markers are not the reader's business


def test_bad_folders_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="no lesson notebooks"):
        build_site(tmp_path, tmp_path / "site")
    (tmp_path / "00_a.ipynb").write_text(nbformat.writes(_notebook()))
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ValueError, match="is a file; name a folder"):
        build_site(tmp_path, tmp_path / "taken")


@pytest.mark.slow  # a fresh interpreter per mistake
def test_the_command_says_what_is_wrong_in_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    done = subprocess.run([sys.executable, "-m", "minipar", "lessons", "--html",
                           str(tmp_path / "file")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "is a file" in done.stderr
    both = subprocess.run([sys.executable, "-m", "minipar", "lessons", "--html", "a",
                           "--student", "b"], capture_output=True, text=True)
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_links_between_notebooks_point_at_the_sites_pages():
    """The site keeps every page in one folder: a lesson's link into deep_dives/ and a
    deep dive's link back (../) both become a page beside them; other links stay."""
    page = ('<a href="deep_dives/06a_memory.ipynb">x</a> <a href="../06_sharded.ipynb#top">y</a>'
            ' <a href="07a_planner.ipynb">z</a> <a href="https://example.org/a.ipynb">w</a>')
    assert site_links(page) == (
        '<a href="06a_memory.html">x</a> <a href="06_sharded.html#top">y</a>'
        ' <a href="07a_planner.html">z</a> <a href="https://example.org/a.ipynb">w</a>')
