"""Notebooks as apps in Voilà (`voila lessons/04_tensor_parallel.ipynb`): every widget is
drawn (no "Error displaying widget"), and a control still works, since Voilà keeps a
kernel behind the page. One page holds every kind of widget; one lesson runs whole
(running all eleven here would take the lessons' nine minutes again: nbval runs them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jupyter_lab
import pytest

pytestmark = [pytest.mark.slow, jupyter_lab.needs_browser]  # slow: drives a real browser
browser, screenshots = jupyter_lab.browser, jupyter_lab.screenshots
LESSON = Path(__file__).resolve().parents[2] / "lessons" / "04_tensor_parallel.ipynb"


@pytest.fixture(scope="module")
def voila(tmp_path_factory):
    """Base URL of a Voilà serving a folder with the all-widgets notebook and one lesson."""
    if shutil.which("voila", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no voila: pip install 'minipar[lessons]'")
    folder = tmp_path_factory.mktemp("apps")
    jupyter_lab.write_notebook(folder, "widgets.ipynb", jupyter_lab.WIDGETS_NOTEBOOK)
    shutil.copyfile(LESSON, folder / LESSON.name)
    port = jupyter_lab._free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("voila")), "--no-browser", f"--port={port}",
         "--Voila.ip=127.0.0.1", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=jupyter_lab._fresh_jupyter(tmp_path_factory.mktemp("voila-state")))
    url = f"http://127.0.0.1:{port}"
    try:
        jupyter_lab.wait_for(url, server, "Voilà")
        yield url
    finally:
        jupyter_lab.stop_server(server)


@pytest.fixture
def app_page(browser):
    context, page = jupyter_lab.recording_page(browser)
    yield page
    context.close()


def _ours(page) -> list[str]:
    """Errors that are not Voilà's template asking a CDN for Font Awesome (no network
    here; minipar's widgets use no icon font)."""
    outside = [u for u in page.failed if "fontawesome" not in u]
    errors = [e for e in page.errors if not e.startswith("Failed to load resource")]
    return outside + errors


def _render(page, voila: str, name: str, views: int, timeout_s: float) -> None:
    page.goto(f"{voila}/voila/render/{name}", timeout=timeout_s * 1000)
    page.wait_for_function(f"document.querySelectorAll('.mp-view svg').length >= {views}",
                           timeout=timeout_s * 1000)
    assert page.get_by_text("Error displaying widget").count() == 0, name
    assert page.locator(".mp-view").count() == views, name


def test_every_widget_is_an_app_and_answers_a_control(app_page, voila, screenshots):
    _render(app_page, voila, "widgets.ipynb", len(jupyter_lab.WIDGETS), 120)
    app_page.screenshot(path=str(screenshots / "voila_widgets.png"))
    title = "document.querySelector('.mp-collective svg text').textContent"
    assert "ring" in app_page.evaluate(title)
    app_page.locator("select").first.select_option("tree")  # the kernel runs it again
    app_page.wait_for_function(f"{title}.includes('tree')", timeout=30_000)
    assert _ours(app_page) == []


def test_a_lesson_is_an_app(app_page, voila):
    _render(app_page, voila, LESSON.name, 1, 240)
    view = app_page.locator(".mp-view").first
    before = view.evaluate("v => v.querySelector('.frames').innerHTML.length")
    app_page.locator("select").first.select_option("row")  # the split viewer's only select
    app_page.wait_for_function("document.querySelector('.mp-view .caption').textContent"
                               ".includes('X split by columns')", timeout=30_000)
    assert view.evaluate("v => v.querySelector('.frames').innerHTML.length") != before
    assert _ours(app_page) == []
