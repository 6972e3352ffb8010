"""What every minipar command line shares: errors in one line (never a traceback),
counts that must be positive, an --out that must be a folder, Ctrl-C, and a one-line
answer to `python -m` of a module that is not a command.

Ctrl-C during start-up (importing torch takes seconds) is one line too: see
interrupt_at_start.py, which the package imports first.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .interrupt_at_start import hand_ctrl_c_back, module_run_by_dash_m


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr ("prog: what to change"),
    exit status 2, without the usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}\n")


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= {minimum}; got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}; got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (ranks, steps)."""
    return _whole_number(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (a demo's option, where 0 may mean "off" or
    "choose for me")."""
    return _whole_number(text, 0)


def output_folder(text: str) -> str:
    """argparse type: a folder to write into, new or existing; never an existing file
    (checked before any work runs, so results are not lost at the end)."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; name a folder (new or existing)")
    return text


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command's body: a ValueError becomes one line and exit status 2, a run whose
    ranks stopped making progress (RankTimeout) one line and 1, Ctrl-C one line and 130
    (the ranks are cleaned up by their Cluster on the way out)."""
    try:
        hand_ctrl_c_back()  # ranks may start now: their Cluster stops them on Ctrl-C
        return body()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    except TimeoutError as err:
        if not hasattr(err, "one_line"):  # not the launcher's RankTimeout
            raise
        print(f"{prog}: {err.one_line()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except ImportError:  # a parent package that does not exist
        return None


def is_command(module: str) -> bool:
    """Whether `python -m module` runs something: a package with a __main__.py, or a
    module with an `if __name__ == "__main__":` block."""
    spec = _spec(module)
    if spec is None or module.endswith(".__main__"):
        return spec is not None
    if spec.submodule_search_locations is not None:
        return _spec(f"{module}.__main__") is not None
    source = Path(spec.origin).read_text() if spec.origin else ""
    return re.search(r"^if __name__ == .__main__.:", source, re.MULTILINE) is not None


def refuse_library_modules() -> None:
    """`python -m minipar.<module>` for a library module would print nothing (or a runpy
    warning about the module being imported twice): say in one line that it is not a
    command and which command shows it, and exit with status 2. Called while the
    `minipar` package is imported, before Python runs the module."""
    module = module_run_by_dash_m()
    if module is None or not module.startswith("minipar.") or _spec(module) is None \
            or is_command(module):
        return  # not ours, not there (Python says so), or a command
    parent = module.rsplit(".", 1)[0]
    while parent != "minipar" and not is_command(parent):
        parent = parent.rsplit(".", 1)[0]
    hint = f"python -m {parent}" + (" --help" if parent == "minipar" else "")
    print(f"{module} is a library module, not a command; try: {hint}", file=sys.stderr)
    raise SystemExit(2)
