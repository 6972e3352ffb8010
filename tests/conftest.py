"""Shared fixtures: one set of live ranks for the whole session keeps the suite fast."""

import os
import tempfile
import time
from pathlib import Path

import cloudpickle
import pytest

import minipar

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Lessons under nbval write their benchmarks' JSON and plots here, never into lessons/.
os.environ.setdefault("MINIPAR_OUT", tempfile.mkdtemp(prefix="minipar-test-out-"))
# Token caches and the measured peak go here, never into the user's ~/.cache/minipar.
os.environ.setdefault("MINIPAR_CACHE", tempfile.mkdtemp(prefix="minipar-test-cache-"))


# runs each lesson's exercise solutions and checks outside the notebook (tests/test_exercises.py)
REPEATS_NBVAL = "test_every_check_accepts_the_notebooks_own_solution"


def pytest_collection_finish(session):
    """Send the test modules' functions to the ranks by value, as a notebook's are. By
    reference, every fresh rank imported the test module (and all it imports) before it
    could run the function: 1-3 s of CPU per rank, paid again by each new set of ranks."""
    modules = {item.module for item in session.items if getattr(item, "module", None)}
    for module in modules:
        cloudpickle.register_pickle_by_value(module)


def pytest_collection_modifyitems(config, items):
    """Notebooks run whole: they belong to the slow set (`-m "not slow"` skips them), and
    the twelve core lessons also carry `lesson`, so the README's test command
    (`-m "not slow or lesson"`) runs them beside the fast tests while the deep dives wait
    for the slow tier. A lesson run under nbval runs its own exercises' solutions and
    checks: in the same session, the test that runs them outside the notebook would only
    repeat it."""
    notebooks = set()
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            notebooks.add(path.stem)
            item.add_marker(pytest.mark.slow)
            if path.parent.name == "lessons":  # lessons/NN_*.ipynb, not lessons/deep_dives/
                item.add_marker(pytest.mark.lesson)
    repeated = [item for item in items if getattr(item, "originalname", "") == REPEATS_NBVAL
                and item.callspec.id in notebooks]
    if repeated:
        config.hook.pytest_deselected(items=repeated)
        items[:] = [item for item in items if item not in repeated]


@pytest.fixture(scope="session")
def cluster4():
    """Four CPU ranks (gloo) shared by every test that only needs working ranks."""
    with minipar.Cluster(4, backend="gloo", timeout=30) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster2():
    with minipar.Cluster(2, backend="gloo", timeout=30) as cluster:
        yield cluster


@pytest.fixture
def faked_device_on(monkeypatch):
    """Ranks launched from the test compute on the faked device (issue 69,
    runtime/faked_device.py): an op of the library's that mixes a host tensor with a
    device tensor fails there, naming its line, as it would on a GPU."""
    monkeypatch.setenv("MINIPAR_FAKED_DEVICE", "1")


def process_gone(pid: int) -> bool:
    """True once `pid` no longer exists; an unreaped zombie still counts as present."""
    if os.path.isdir("/proc"):
        return not os.path.exists(f"/proc/{pid}")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_gone(pids, seconds: float = 5.0) -> list:
    """The pids still present after waiting up to `seconds` for them to disappear."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if not process_gone(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if not process_gone(p)]


def child_pids(parent: int | None = None) -> set:
    """Live (non-zombie) processes whose parent is `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.add(int(entry))
    return found


def value_errors(*calls) -> list[str]:
    """Each call's ValueError message, or "no error": how tests check (often inside a rank)
    that bad input is refused with a message naming what to change."""
    messages = []
    for call in calls:
        try:
            call()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def grad_mismatches(layer, twin, first_expert: int) -> list[str]:
    """Names of `layer`'s parameters whose gradient differs from the one-process twin's,
    this rank's experts renumbered from `first_expert` (float64 tolerances)."""
    import torch

    want = dict(twin.named_parameters())
    wrong = []
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            index, rest = name.split(".", 2)[1:]
            name = f"experts.{first_expert + int(index)}.{rest}"
        if not torch.allclose(p.grad, want[name].grad, rtol=1e-10, atol=1e-12):
            wrong.append(name)
    return wrong
