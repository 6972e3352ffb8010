"""Ctrl-C while a minipar command is still starting: one line and exit status 130.

A command spends its first seconds importing (torch alone takes seconds; on a fresh clone
every module is compiled first). Python's own answer to Ctrl-C there is a KeyboardInterrupt
traceback from inside whatever import it hit. `minipar/__init__.py` imports this module
before anything else, and importing it installs a handler that prints
"python -m minipar.mesh: interrupted" and exits with 130; `cli.run_command` hands Ctrl-C
back to Python once the command's body runs and ranks may start.

This module imports only `sys`, `os` and `_signal` (the C half of `signal`), which the
interpreter loads at its own start-up, so the handler is in place a few milliseconds after
the package's first line runs. `import signal` itself builds its enums with
`enum`, which a cold start compiles first: a Ctrl-C landed there once (a CI failure).
"""

import _signal  # what `signal` wraps: already loaded at interpreter start-up (see above)
import os
import sys


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


def _command_name() -> str | None:
    """How the user started this process, if it is a minipar command; None otherwise."""
    module = module_run_by_dash_m()
    if module is not None:
        return f"python -m {module}" if module.split(".")[0] == "minipar" else None
    return "minipar" if os.path.basename(sys.argv[0] if sys.argv else "") == "minipar" else None


# The command's name, taken when the handler is installed: by the time Ctrl-C lands,
# runpy may already have replaced sys.argv[0] ("-m") with the module's path.
_starting_command: str | None = None


def interrupted_while_starting(signum: int, frame: object) -> None:
    """The start-up handler: one line, then exit at once with 130 (128 + SIGINT)."""
    try:  # os.write, not print: Ctrl-C may land inside a print to stderr (reentrant call)
        os.write(2, f"{_starting_command}: interrupted\n".encode())
    finally:
        os._exit(130)  # nothing to clean up yet: no rank has started


def hand_ctrl_c_back() -> None:
    """From here on Ctrl-C is Python's KeyboardInterrupt again (a command's body catches
    it, so its Cluster can stop the ranks it started)."""
    if _signal.getsignal(_signal.SIGINT) is interrupted_while_starting:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def _install() -> None:
    global _starting_command
    name = _command_name()
    if name is None or _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:
        return  # someone else's program, or Ctrl-C already handled by whoever runs us
    _starting_command = name
    try:
        _signal.signal(_signal.SIGINT, interrupted_while_starting)
    except ValueError:  # not the main thread
        pass


_install()
