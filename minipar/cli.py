"""What every minipar command line shares: errors in one line (never a traceback),
counts that must be positive, an --out that must be a folder, Ctrl-C, and a one-line
answer to `python -m` of a module that is not a command.

Importing this module in a process that is a minipar command (`minipar ...` or `python -m
minipar...`) makes Ctrl-C during start-up (importing torch takes seconds) one line too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path


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
    """Run a command's body: a ValueError becomes one line and exit status 2, Ctrl-C one
    line and 130 (the ranks are cleaned up by their Cluster on the way out)."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # ranks may start now
    try:
        return body()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def module_run_by_dash_m() -> str | None:
    """The module `python -m MODULE` is starting, while Python imports its packages
    (sys.argv[0] is "-m" until the module itself runs); None otherwise."""
    if sys.argv[:1] != ["-m"]:
        return None
    argv = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(argv[1:-1], start=1):
        if arg == "-m":
            return argv[i + 1]
    return None


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


def _command_name() -> str | None:
    """How the user started this process, if it is a minipar command; None otherwise."""
    module = module_run_by_dash_m()
    if module is not None:
        return f"python -m {module}" if module.split(".")[0] == "minipar" else None
    return "minipar" if os.path.basename(sys.argv[0] if sys.argv else "") == "minipar" else None


# The command's name, taken when the start-up handler is installed: by the time Ctrl-C
# lands, runpy may already have replaced sys.argv[0] ("-m") with the module's path, and on
# a cold start (no .pyc yet) that window is seconds wide.
_starting_command: str | None = None


def _interrupted_while_starting(signum: int, frame: object) -> None:
    print(f"{_starting_command}: interrupted", file=sys.stderr, flush=True)
    os._exit(130)  # nothing to clean up yet: no rank has started


def _quiet_interrupts_while_starting() -> None:
    """Until `run_command` takes over, Ctrl-C in a minipar command is one line and exit
    status 130, not a KeyboardInterrupt traceback from inside an import."""
    global _starting_command
    name = _command_name()
    if name is None or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # someone else's program, or Ctrl-C already handled by whoever runs us
    _starting_command = name
    try:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # not the main thread
        pass


_quiet_interrupts_while_starting()
