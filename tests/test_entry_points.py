"""Every `python -m minipar...` command the README and docs/running_ranks.md name runs and
says what it did; every command has a full help text; `python -m` of a library module
answers in one line."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from minipar.cli import is_command

ROOT = Path(__file__).resolve().parent.parent
README_COMMANDS = sorted(set(re.findall(
    r"-m\s+(minipar(?:\.\w+)*)", (ROOT / "README.md").read_text()
    + (ROOT / "docs" / "running_ranks.md").read_text())))
# every package with a __main__ but the GPU check, a tool of its own (docs/gpus.md)
TECHNIQUES = sorted(f"minipar.{p.parent.name}" for p in (ROOT / "minipar").glob("*/__main__.py")
                    if p.parent.name != "gpu_check")
SMALL = {  # options that keep each run short; every command also gets --ranks 2
    "minipar.collectives": ["--numel", "4096"],
    "minipar.sharded": ["--cases", "zero1", "zero3"],
    "minipar.slow_networks": ["--cases", "local_sgd", "top_k"],
    "minipar.train": ["--steps", "5", "--warmup-steps", "2", "--check",
                      "--out", tempfile.mkdtemp(prefix="minipar-run-")],
    "minipar.slow_networks.elastic": ["--steps", "4"],
}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_the_readme_names_every_technique_and_only_commands():
    assert set(TECHNIQUES) <= set(README_COMMANDS), "docs/running_ranks.md lacks a `-m` for: " \
        f"{sorted(set(TECHNIQUES) - set(README_COMMANDS))}"
    assert all(is_command(module) for module in README_COMMANDS)
    assert not is_command("minipar.data_parallel.parameter_server")


@pytest.mark.slow  # a fresh interpreter per command, each starting ranks
@pytest.mark.parametrize("module", README_COMMANDS)
def test_every_command_the_readme_names_runs_and_says_what_it_did(module):
    done = _run([module, "--ranks", "2", "--timeout", "100", *SMALL.get(module, [])], 150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert re.search(r"match(es)? one process", done.stdout), done.stdout
    assert not re.search(r"\bNO\b", done.stdout), done.stdout


@pytest.mark.parametrize("module", README_COMMANDS)
def test_every_command_has_a_full_help_text(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    # a module another test imported would be run a second time beside its imported copy
    # (runpy warns "found in sys.modules"): run it as python -m would, fresh
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delitem(sys.modules, f"{module}.__main__", raising=False)  # a package's
    with pytest.raises(SystemExit) as done:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert done.value.code == 0
    usage, description, *sections = capsys.readouterr().out.split("\n\n")
    assert usage.startswith(f"usage: python -m {module} ")
    assert len(description.split()) >= 12, f"a description, not a stub: {description!r}"
    options = "\n".join(sections).splitlines()[1:]
    for line, after in zip(options, options[1:] + [""], strict=True):
        if line.lstrip().startswith("-"):  # its help is beside it or on the next line
            flags, _, beside = line.strip().partition("  ")
            assert beside.strip() or after.startswith(" " * 8), f"{module}: {flags} has no help"


@pytest.mark.parametrize("module, command", [
    ("minipar.data_parallel.parameter_server", "python -m minipar.data_parallel"),
    ("minipar.data_parallel.ddp", "python -m minipar.data_parallel"),  # imported by its package
    ("minipar.trace", "python -m minipar --help"),
])
@pytest.mark.slow  # a fresh interpreter per module
def test_a_library_module_says_it_is_not_a_command(module, command):
    done = _run([module], 60)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.strip().splitlines() == [
        f"{module} is a library module, not a command; try: {command}"]
