"""The browser-drawn widgets in JupyterLab: they render (no "Error displaying widget"),
answer their controls, play without the kernel, zoom, show details on hover, grey out an
impossible choice, and log no console errors."""

from __future__ import annotations

import jupyter_lab
import pytest

pytestmark = [pytest.mark.slow, jupyter_lab.needs_browser]  # slow: drives a real browser
# the session's JupyterLab and browser, a fresh page per test, the screenshot folder
browser, lab, page, screenshots = (jupyter_lab.browser, jupyter_lab.lab, jupyter_lab.page,
                                   jupyter_lab.screenshots)

NOTEBOOK = [
    "from minipar.pipeline import schedule, simulate\n"
    "from minipar.widgets import ScheduleExplorer, TimelineViewer",
    'explorer = ScheduleExplorer("1f1b", 4, 8)\nexplorer',
    'TimelineViewer(simulate(schedule("gpipe", 2, 4), {"F": 1e-3, "B": 2e-3}), '
    'title="gpipe, 2 stages", play_ms=600)',
]


def _gantt_state(page, index: int) -> dict:
    return page.evaluate("""(i) => {
        const root = document.querySelectorAll('.mp-gantt')[i];
        const first = root.querySelector('svg');
        return {cursor: Number(root.dataset.cursor), draws: Number(root.dataset.draws),
                shown: Number(first.dataset.shown),
                title: first.querySelector('text').textContent,
                signature: [...root.querySelectorAll('rect[data-e], path')].map(
                    r => (r.getAttribute('x') || '') + (r.getAttribute('d') || '')).join(','),
                ticks: [...first.querySelectorAll('text')].map(t => t.textContent).join('|'),
                greyed: root.classList.contains('greyed'),
                reason: root.querySelector('.reason').textContent};
    }""", index)


def test_schedule_explorer_and_timeline_viewer(page, lab, screenshots):
    name = jupyter_lab.write_notebook(lab[2], "gantt.ipynb", NOTEBOOK)
    jupyter_lab.run_all(page, lab, name)
    page.wait_for_selector(".mp-gantt svg rect[data-e]", timeout=jupyter_lab.WAIT_MS)
    if page.get_by_text("Would you like to get notified").count():  # JupyterLab's news toast
        page.get_by_role("button", name="No", exact=True).first.click()
    assert page.locator(".mp-gantt").count() == 2
    assert page.get_by_text("Error displaying widget").count() == 0
    outputs = page.locator(".jp-OutputArea-output").filter(has=page.locator(".mp-gantt"))
    outputs.first.scroll_into_view_if_needed()
    outputs.first.screenshot(path=str(screenshots / "schedule_explorer.png"))

    before = _gantt_state(page, 0)
    assert before["title"].startswith("ideal (simulated): bubble 27.3%")
    assert before["cursor"] == 1 and before["shown"] > 0

    # a control changes the drawing (the kernel recomputes, the browser redraws)
    page.locator(".jupyter-widgets select").first.select_option("gpipe")
    page.wait_for_function(f"Number(document.querySelector('.mp-gantt').dataset.draws) > "
                           f"{before['draws']}", timeout=jupyter_lab.WAIT_MS)
    assert _gantt_state(page, 0)["signature"] != before["signature"]  # GPipe: all F first

    # an impossible choice greys the picture and says why: interleaved, 2 virtual stages,
    # 6 micro-batches (not a multiple of the 4 stages)
    page.locator(".jupyter-widgets select").first.select_option("interleaved_1f1b")
    sliders = page.locator(".jupyter-widgets .noUi-handle")
    sliders.nth(2).press("ArrowRight")  # virtual 1 -> 2
    sliders.nth(1).press("ArrowLeft")  # micro-batches 8 -> 7
    page.wait_for_function("document.querySelector('.mp-gantt').classList.contains('greyed')",
                           timeout=jupyter_lab.WAIT_MS)
    assert "multiple of" in _gantt_state(page, 0)["reason"]
    assert page.evaluate("getComputedStyle(document.querySelector('.mp-gantt svg')).opacity")\
        == "0.3"
    outputs.first.screenshot(path=str(screenshots / "schedule_explorer_impossible.png"))
    sliders.nth(1).press("ArrowRight")  # back to 8: valid again
    page.wait_for_function("!document.querySelector('.mp-gantt').classList.contains('greyed')",
                           timeout=jupyter_lab.WAIT_MS)

    # Play runs in the browser: the cursor moves and fewer actions are drawn mid-way
    viewer = page.locator(".mp-gantt").nth(1)
    viewer.scroll_into_view_if_needed()
    full = _gantt_state(page, 1)
    viewer.locator("button.play").click()
    page.wait_for_function("Number(document.querySelectorAll('.mp-gantt')[1].dataset.cursor) < 1",
                           timeout=jupyter_lab.WAIT_MS)
    mid = _gantt_state(page, 1)
    assert mid["cursor"] < 1 and mid["shown"] <= full["shown"]
    page.wait_for_function("Number(document.querySelectorAll('.mp-gantt')[1].dataset.cursor)"
                           " === 1", timeout=jupyter_lab.WAIT_MS)
    assert _gantt_state(page, 1)["draws"] > full["draws"] + 3  # several frames were drawn

    # hover shows an action's details
    viewer.locator("rect[data-e]").first.hover()
    tip = viewer.locator(".tip")
    assert tip.is_visible() and "rank 0" in tip.inner_text() and " ms" in tip.inner_text()

    # the wheel zooms the time axis: other tick labels
    box = viewer.locator("svg").first.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.wheel(0, -600)
    page.wait_for_timeout(300)
    assert _gantt_state(page, 1)["ticks"] != full["ticks"]
    outputs.nth(1).screenshot(path=str(screenshots / "timeline_viewer_zoomed.png"))
    viewer.locator("button.reset").click()
    assert _gantt_state(page, 1)["ticks"] == full["ticks"]
    # a 404 from JupyterLab's own optional endpoints is the server's business; a script,
    # style or widget module that failed to load is ours
    errors = [e for e in page.errors if not e.startswith("Failed to load resource")]
    missing = [m for m in page.missing if "/api/" not in m and "favicon" not in m]
    assert errors == [] and missing == [], (errors, page.missing)
