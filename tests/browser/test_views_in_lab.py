"""Every other widget in JupyterLab: drawn by the browser as SVG (no "Error displaying
widget"), Play stepping frames without the kernel, a control changing the drawing, an
impossible choice greyed with its reason, hover details, no console errors. Each widget's
screenshot goes to the screenshot folder (the README shows them)."""

from __future__ import annotations

import jupyter_lab
import pytest

pytestmark = [pytest.mark.slow, jupyter_lab.needs_browser]  # slow: drives a real browser
browser, lab, page, screenshots = (jupyter_lab.browser, jupyter_lab.lab, jupyter_lab.page,
                                   jupyter_lab.screenshots)

WIDGETS, NOTEBOOK = jupyter_lab.WIDGETS, jupyter_lab.WIDGETS_NOTEBOOK


def _state(page, index: int) -> dict:
    return page.evaluate("""(i) => {
        const root = document.querySelectorAll('.mp-view')[i];
        return {frame: Number(root.dataset.frame), frames: Number(root.dataset.frames),
                draws: Number(root.dataset.draws), greyed: root.classList.contains('greyed'),
                reason: root.querySelector('.reason').textContent,
                text: [...root.querySelectorAll('svg text')].filter(
                    t => getComputedStyle(t.closest('.frames > div') || root).visibility
                         !== 'hidden').map(t => t.textContent).join('|'),
                width: root.getBoundingClientRect().width,
                height: root.getBoundingClientRect().height};
    }""", index)


def _wait_draws(page, index: int, more_than: int) -> None:
    page.wait_for_function(f"Number(document.querySelectorAll('.mp-view')[{index}]"
                           f".dataset.draws) > {more_than}", timeout=jupyter_lab.WAIT_MS)


def test_every_widget_draws_plays_and_answers_its_controls(page, lab, screenshots):
    name = jupyter_lab.write_notebook(lab[2], "views.ipynb", NOTEBOOK)
    jupyter_lab.run_all(page, lab, name, timeout_s=180)
    page.wait_for_function(f"document.querySelectorAll('.mp-view svg').length >= {len(WIDGETS)}",
                           timeout=jupyter_lab.WAIT_MS)
    assert page.get_by_text("Error displaying widget").count() == 0
    views = page.locator(".mp-view")
    assert views.count() == len(WIDGETS)
    outputs = page.locator(".jp-OutputArea-output").filter(has=page.locator(".mp-view"))
    for index, shot in enumerate(WIDGETS):
        outputs.nth(index).scroll_into_view_if_needed()
        outputs.nth(index).screenshot(path=str(screenshots / f"{shot}.png"))
        state = _state(page, index)
        assert not state["greyed"] and state["text"], (shot, state)
        assert state["height"] < 1100, (shot, state)  # nothing stretched to a page of its own

    # CollectiveAnimator: Play walks the real run's steps in the browser; the label and
    # the slider agree; hover names the rank and value; a new algorithm runs at once
    collective = views.nth(0)
    collective.scroll_into_view_if_needed()
    assert _state(page, 0)["frames"] == 7  # ring on 4 ranks: start + 6 steps
    collective.locator("button.play").click()
    page.wait_for_function("Number(document.querySelectorAll('.mp-view')[0].dataset.frame) >= 2",
                           timeout=jupyter_lab.WAIT_MS)
    collective.locator("button.play").click()  # pause
    frame = _state(page, 0)["frame"]
    assert collective.locator(".step").inner_text().startswith(f"step {frame} of 6")
    assert collective.locator("input.frame").input_value() == str(frame)
    collective.locator("rect[data-tip]").first.hover()
    tip = collective.locator(".tip")
    assert tip.is_visible() and "rank 0, element 0" in tip.inner_text()
    draws = _state(page, 0)["draws"]
    page.locator(".jupyter-widgets select").first.select_option("tree")
    page.wait_for_function("document.querySelectorAll('.mp-view')[0].querySelector('svg text')"
                           ".textContent.includes('tree')", timeout=90_000)
    assert _state(page, 0)["draws"] > draws and _state(page, 0)["frame"] == 0

    # RingAnimator: Play advances the frames without the page moving; an impossible
    # choice greys the picture and says why
    ring = views.nth(1)
    ring.scroll_into_view_if_needed()
    height = _state(page, 1)["height"]
    ring.locator("button.play").click()
    page.wait_for_function("Number(document.querySelectorAll('.mp-view')[1].dataset.frame) >= 2",
                           timeout=jupyter_lab.WAIT_MS)
    assert abs(_state(page, 1)["height"] - height) < 2  # frames share one height
    checkboxes = outputs.nth(1).locator("input[type=checkbox]")
    checkboxes.nth(0).uncheck()  # no causal mask ...
    checkboxes.nth(1).check()  # ... but balanced: not possible
    page.wait_for_function("document.querySelectorAll('.mp-view')[1].classList.contains('greyed')",
                           timeout=jupyter_lab.WAIT_MS)
    assert "causal" in _state(page, 1)["reason"]
    outputs.nth(1).screenshot(path=str(screenshots / "ring_animator_impossible.png"))
    checkboxes.nth(0).check()
    page.wait_for_function("!document.querySelectorAll('.mp-view')[1].classList.contains("
                           "'greyed')", timeout=jupyter_lab.WAIT_MS)

    # the split viewer: a new split redraws every step
    split = _state(page, 3)
    outputs.nth(3).locator("select").first.select_option("row")
    _wait_draws(page, 3, split["draws"])
    assert _state(page, 3)["text"] != split["text"]

    errors = [e for e in page.errors if not e.startswith("Failed to load resource")]
    missing = [m for m in page.missing if "/api/" not in m and "favicon" not in m]
    assert errors == [] and missing == [], (errors, page.missing)
