"""What every minipar command line shares: errors in one line (never a traceback),
counts that must be positive, an --out that must be a folder, and Ctrl-C."""

from __future__ import annotations

import argparse
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
    try:
        return body()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
