"""A real browser for the widget tests: JupyterLab on a free loopback port with a token,
driven by Playwright through Debian's Chromium (never a downloaded browser). Test modules
import these fixtures and `needs_browser`: without Chromium or Playwright they skip with
one line saying how to get them. (Not a conftest.py: the suite's own conftest is
imported by name, and a second one would shadow it.)"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("MINIPAR_CHROMIUM") or shutil.which("chromium") \
    or shutil.which("chromium-browser")
HOW = "no browser: apt-get install -y chromium and pip install playwright (or set MINIPAR_CHROMIUM)"
# how long a test waits for the page to change (ms): a hang guard, not a speed check. A
# change that goes through the kernel (a control moved, the widget recomputed and redrawn)
# took over 15 s on two cores beside a busy loop and eight ranks' tests
WAIT_MS = 90_000


def _have_browser() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return CHROMIUM is not None


needs_browser = pytest.mark.skipif(not _have_browser(), reason=HOW)

# every widget drawn by the browser, one per cell in this order (screenshots are named by it)
WIDGETS = {
    "collective_animator": 'CollectiveAnimator("ring", 4)',
    "ring_animator": "RingAnimator(ranks=4, causal=True, balanced=False)",
    "all_to_all_animator": 'AllToAllAnimator(layout="2 nodes x 4", kind="hierarchical")',
    "split_viewer": 'split_viewer("megatron_mlp", 2)',
    "router_explorer": "RouterExplorer()",
    "memory_explorer": "MemoryExplorer(params=65e9, ranks=64, mixed=True, device_gb=80)",
    "mesh_viewer": "MeshViewer(dp=2, pp=2, tp=2)",
    "planner_explorer": 'PlannerExplorer("13B", nodes=2)',
}
WIDGETS_NOTEBOOK = [
    "from minipar.widgets import (AllToAllAnimator, CollectiveAnimator, MemoryExplorer, "
    "MeshViewer, PlannerExplorer, RingAnimator, RouterExplorer, split_viewer)",
    *WIDGETS.values()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory) -> Path:
    """Where screenshots go: $MINIPAR_SCREENSHOTS, else a temporary folder (printed)."""
    chosen = os.environ.get("MINIPAR_SCREENSHOTS")
    folder = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _fresh_jupyter(state: Path) -> dict[str, str]:
    """The environment for a JupyterLab with its own settings, workspaces and runtime files
    (as on a fresh machine, whatever the user's ~/.jupyter holds)."""
    env = dict(os.environ)
    for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                      ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                      ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
        env[name] = str(state / sub)
    news = state / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True, exist_ok=True)  # no "Would you like to get notified" toast
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    return env


# Each test module that assigns these fixtures gets its own copy of them, so the
# session-wide things (one JupyterLab, one Playwright with its browser) are shared here,
# counted, and stopped when the last module using them is done.
_SHARED: dict[str, list] = {}


def _shared(name: str, start, stop):
    if name not in _SHARED:
        _SHARED[name] = [start(), 0]
    _SHARED[name][1] += 1
    try:
        yield _SHARED[name][0]
    finally:
        _SHARED[name][1] -= 1
        if _SHARED[name][1] == 0:
            stop(_SHARED.pop(name)[0])


def _start_lab(folder: Path, state: Path):
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = Path(sys.executable).with_name("jupyter")
    server = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--notebook-dir={folder}",
         "--LabApp.news_url="],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_fresh_jupyter(state))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/api/status?token={token}", server, "JupyterLab")
    except RuntimeError:
        stop_server(server)
        raise
    return server, (url, token, folder)


def wait_for(url: str, server: subprocess.Popen, what: str, seconds: float = 60) -> None:
    """Return once `url` answers; raise if `server` exits or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"{what} did not start within {seconds:.0f} s") from None
            time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """(base url, token, notebook folder) of a JupyterLab started for the session."""
    folder = tmp_path_factory.mktemp("notebooks")
    state = tmp_path_factory.mktemp("jupyter-state")
    for server_and_lab in _shared("lab", lambda: _start_lab(folder, state),
                                  lambda started: stop_server(started[0])):
        yield server_and_lab[1]


def _start_browser():
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    return playwright, playwright.chromium.launch(executable_path=CHROMIUM,
                                                  args=["--no-sandbox", "--disable-gpu"])


def _stop_browser(started) -> None:
    playwright, chromium = started
    chromium.close()
    playwright.stop()


@pytest.fixture(scope="session")
def browser():
    for started in _shared("browser", _start_browser, _stop_browser):
        yield started[1]


def recording_page(browser):
    """A fresh page (and its context) that records console errors and page errors in
    `page.errors`, responses of 400 and above in `page.missing`, and requests that got
    no answer in `page.failed`."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.errors, page.missing, page.failed = [], [], []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("response", lambda r: page.missing.append(f"{r.status} {r.url}")
            if r.status >= 400 else None)
    page.on("requestfailed", lambda r: page.failed.append(r.url))
    return context, page


@pytest.fixture
def page(browser):
    """A fresh page that records what went wrong (see `recording_page`)."""
    context, page = recording_page(browser)
    yield page
    context.close()


def write_notebook(folder, name: str, cells: list[str]) -> str:
    """A notebook of these code cells in `folder`; returns its name."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / name)
    return name


def run_all(page, lab, name: str, timeout_s: float = 120) -> None:
    """Open a notebook and run its cells one by one with Shift+Enter, each after the one
    before has run (steadier than the Run menu, whose clicks a busy page can drop); the
    first key is pressed again if the page was not ready for it."""
    url, token, _ = lab
    # a workspace of its own: JupyterLab would otherwise reopen the notebooks an earlier
    # test left open, and their widgets would be on the page too
    page.goto(f"{url}/lab/workspaces/{Path(name).stem}/tree/{name}?token={token}")
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
    prompts = page.locator(".jp-Notebook .jp-CodeCell .jp-InputPrompt")
    for _attempt in range(5):  # a key pressed while the page is still settling is lost
        prompts.first.click()
        page.keyboard.press("Escape")  # command mode: Shift+Enter runs and moves on
        page.keyboard.press("Shift+Enter")
        started = time.monotonic()
        while time.monotonic() - started < 8:
            if re.search(r"\[(\d+|\*)\]", prompts.first.inner_text()):
                break
            time.sleep(0.2)
        else:
            continue
        break
    deadline = time.monotonic() + timeout_s
    for index in range(prompts.count()):
        if index:
            page.keyboard.press("Shift+Enter")
        while not re.search(r"\[\d+\]", prompts.nth(index).inner_text()):
            if time.monotonic() > deadline:
                raise AssertionError(f"cell {index} still running after {timeout_s} s: "
                                     f"{prompts.all_inner_texts()}")
            time.sleep(0.2)
    if page.get_by_text("Would you like to get notified").count():  # JupyterLab's news toast
        page.get_by_role("button", name="No", exact=True).first.click()
