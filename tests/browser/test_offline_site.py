"""The lessons as an offline site (`minipar lessons --html`), opened in Chromium with every
request outside the site refused: every widget of every lesson renders from its saved
state, the schedule and collective widgets still Play with no kernel, nothing is fetched
from elsewhere and nothing logs an error."""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
from pathlib import Path

import jupyter_lab
import pytest

from minipar.lesson_site import build_site, site_assets

pytestmark = [pytest.mark.slow, jupyter_lab.needs_browser]  # slow: drives a real browser
browser, screenshots = jupyter_lab.browser, jupyter_lab.screenshots
LESSONS = Path(__file__).resolve().parents[2] / "lessons"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from the lessons' saved outputs, served on a free loopback port."""
    try:
        site_assets()
    except RuntimeError as err:
        pytest.skip(f"no site assets: {err}")
    folder = tmp_path_factory.mktemp("site")
    pages = build_site(LESSONS, folder, execute=False, progress=lambda _: None)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # the test reports what matters
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", [p.name for p in pages]
    server.shutdown()


@pytest.fixture
def offline(browser, site):
    """A page that may load only the site: anything else is refused and recorded."""
    base, _ = site
    context, page = jupyter_lab.recording_page(browser)
    page.refused = []

    def only_the_site(route):
        if route.request.url.startswith(base):
            return route.continue_()
        page.refused.append(route.request.url)
        return route.abort()

    context.route("**/*", only_the_site)
    yield page
    context.close()


VIEWS = "script[type='application/vnd.jupyter.widget-view+json']"


def test_every_lesson_page_renders_its_widgets_offline(offline, site, screenshots):
    base, pages = site
    notebooks = list(LESSONS.glob("*.ipynb")) + list((LESSONS / "deep_dives").glob("*.ipynb"))
    with_formulas = {p.with_suffix(".html").name for p in notebooks
                     if re.search(r"\$[^$\n]+\$", "".join(
                         "".join(c["source"]) for c in json.loads(p.read_text())["cells"]
                         if c["cell_type"] == "markdown"))}
    assert with_formulas  # the check below has something to check
    offline.goto(base + "index.html")
    # a page per lesson and deep dive, each listed once (deep dives under their lesson)
    assert offline.locator("li a").count() == len(pages) == len(notebooks)
    for name in pages:
        offline.goto(base + name)
        expected = offline.locator(VIEWS).count()
        offline.wait_for_function(
            f"document.querySelectorAll('.widget-subarea > *').length >= {expected}",
            timeout=jupyter_lab.WAIT_MS)
        offline.wait_for_function(  # the browser-drawn views have drawn
            "[...document.querySelectorAll('.mp-view')].every("
            "v => v.querySelector('svg') || v.dataset.frames === '0')",  # 0: empty until run
            timeout=jupyter_lab.WAIT_MS)
        assert offline.get_by_text("Error displaying widget").count() == 0, name
        if name in with_formulas:  # MathJax, served from the site, typeset them
            offline.wait_for_selector("mjx-container svg", timeout=jupyter_lab.WAIT_MS)
        assert offline.refused == offline.errors == offline.missing == [], (
            name, offline.refused, offline.errors, offline.missing)


def test_schedule_and_collective_widgets_play_without_a_kernel(offline, site, screenshots):
    base, _ = site
    offline.goto(base + "03_pipeline.html")
    gantt = offline.locator(".mp-gantt").first
    gantt.wait_for(timeout=jupyter_lab.WAIT_MS)
    gantt.scroll_into_view_if_needed()
    gantt.locator("button.play").click()
    offline.wait_for_function("Number(document.querySelector('.mp-gantt').dataset.cursor) < 1",
                              timeout=jupyter_lab.WAIT_MS)
    offline.wait_for_function("Number(document.querySelector('.mp-gantt').dataset.cursor) === 1",
                              timeout=jupyter_lab.WAIT_MS)
    gantt.screenshot(path=str(screenshots / "offline_schedule_explorer.png"))

    offline.goto(base + "01_collectives.html")
    collective = offline.locator(".mp-collective").first
    collective.wait_for(timeout=jupyter_lab.WAIT_MS)
    collective.scroll_into_view_if_needed()
    collective.locator("button.play").click()
    offline.wait_for_function(
        "Number(document.querySelector('.mp-collective').dataset.frame) >= 2",
        timeout=jupyter_lab.WAIT_MS)
    collective.screenshot(path=str(screenshots / "offline_collective_animator.png"))
    assert offline.refused == offline.errors == offline.missing == [], (
        offline.refused, offline.errors, offline.missing)
