"""What every exercise check shares: running the learner's function on real ranks
and turning a crash, a missing answer or a deadlock into a hint.

Each technique's `exercises.py` holds its lesson's checks; they run the learner's
function on real ranks against a single-process reference and raise
`ExerciseError` saying what is wrong, rank by rank.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch

from .runtime import RankError, RankTimeout, launch


class ExerciseError(AssertionError):
    """The learner's function ran but gave a wrong answer; the message says where."""


def refuse_library(name: str, fn: object) -> None:
    """A learner who passes minipar's own implementation (or torch's) has not written the
    exercise: say so instead of grading it."""
    # a partial keeps the wrapped function's module in .func, not on itself
    inner = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(inner, "__module__", "") or ""
    if module.startswith(("minipar.", "torch.")):
        raise ExerciseError(f"{name}: that is {module}.{getattr(inner, '__qualname__', inner)}, "
                            "the library's own implementation; write your own in the cell above "
                            "(you may call minipar's send/recv and torch.distributed inside it).")


_MISMATCH = ("sent or received a tensor whose size or dtype does not match its peer's. "
             "Allocate receive buffers like what is sent (torch.empty_like(tensor)), and keep "
             "one dtype: the data here is float64, and torch.empty(n) is float32.")
CRASH_HINTS = {"size mismatch": _MISMATCH, "match expected size": _MISMATCH,
               "dtype": _MISMATCH, "expected scalar type": _MISMATCH}
DEADLOCK_HINT = ("A blocking send can wait for its receiver forever: post each step's send "
                 "and receive together (dist.batch_isend_irecv, or isend + irecv and wait on "
                 "both).")


def run_on_ranks(name: str, fn: Callable, world_size: int, *args, timeout: float = 30,
                 crash_hints: dict[str, str] | None = None,
                 deadlock_hint: str = DEADLOCK_HINT) -> list:
    """Run `fn(*args)` on `world_size` gloo ranks and return each rank's result. Whatever
    goes wrong becomes an `ExerciseError` naming the rank: a NotImplementedError, a crash
    whose message contains a key of `crash_hints` (default: size and dtype mismatches) with
    that hint, any other crash with the line of the learner's code it came from, and a
    deadlock with where each rank waited and `deadlock_hint`."""
    # a check's own hints come second, so they win over the defaults on the same words
    hints = CRASH_HINTS if crash_hints is None else {**CRASH_HINTS, **crash_hints}
    try:
        # gloo: exercises run on CPU ranks everywhere; the timeout turns a deadlock into a hint
        return launch(fn, world_size, *args, backend="gloo", timeout=timeout)
    except RankError as err:
        text = str(err)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        first = lines[0] if not lines[0].endswith(":") or len(lines) < 2 else \
            f"{lines[0]} {lines[-1]}"  # a crashed rank: its last words say why
        if "NotImplementedError" in first:
            raise ExerciseError(f"{name}: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        where = _learner_line(err.remote_traceback)
        where = f"\n  in your code: {where}" if where else ""
        hint = next((h for words, h in hints.items() if words.lower() in text.lower()), None)
        if hint:
            raise ExerciseError(f"{name}: rank {err.rank} {hint} ({first}){where}") from None
        raise ExerciseError(f"{name}: {first}{where}") from None
    except RankTimeout as err:
        waits = "; ".join(f"rank {r} {where}" for r, where in sorted(err.waiting.items()))
        raise ExerciseError(
            f"{name} on {world_size} ranks did not finish in {timeout:g}s: a deadlock? {waits}. "
            + deadlock_hint) from None


_LIBRARY_DIRS = (str(Path(__file__).parent), str(Path(torch.__file__).parent))


def _learner_line(remote_traceback: str) -> str:
    """The last frame of a rank's traceback that is not minipar's or torch's: where the
    learner's own code was when it failed."""
    lines = remote_traceback.splitlines()
    frames = [i for i, line in enumerate(lines) if line.strip().startswith("File ")
              and not any(d in line for d in _LIBRARY_DIRS)]
    if not frames:
        return ""
    i = frames[-1]
    # a frame's source line follows its "File" line, unless Python could not read the source
    code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith(
        ("File ", "Traceback")) else ""
    return lines[i].strip() + (f": {code}" if code else "")


# torch's collectives: a learner who calls one inside an exercise has not written it
TORCH_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all",
                     "all_to_all_single", "scatter", "gather")
# minipar's files whose messages count as the learner's own: point to point, which the
# exercises allow
_OWN_MESSAGES = (str(Path(__file__).parent / "collectives" / "p2p.py"),)


def _library_caller(frame: FrameType | None) -> str | None:
    """Which of minipar's functions the learner's code called to make this call (say
    "minipar.collectives.all_reduce.all_reduce"), walking up from `frame` past torch's and
    minipar's frames to the first of the learner's own; None when the learner's code (or
    minipar's point-to-point send and receive) made it."""
    outermost = None
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith(_LIBRARY_DIRS[0]):
            outermost = frame
        elif not file.startswith(_LIBRARY_DIRS[1]):
            break  # the learner's own code: what it called is `outermost`
        frame = frame.f_back
    if outermost is None or outermost.f_code.co_filename in _OWN_MESSAGES:
        return None
    return f"{outermost.f_globals.get('__name__', '?')}.{outermost.f_code.co_qualname}"


class SendLog:
    """Inside a rank: record every message this rank sends (destination, a copy of the data).

    Only messages the learner's own code sends are logged, with torch.distributed's
    send/isend or minipar's point-to-point ones. A call that hands the work to a built-in
    collective instead (torch's dist.all_reduce, or minipar's collectives.all_reduce whose
    messages would otherwise look like the learner's) goes to `delegated` as (how many
    messages the learner had sent by then, the function called), so a check can say so.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []
        self.delegated: list[tuple[int, str]] = []

    def __enter__(self) -> list[tuple[int, torch.Tensor]]:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.sent.clear()
        self.delegated.clear()
        names = ("isend", "send", *(n for n in TORCH_COLLECTIVES if hasattr(c10d, n)))
        self.saved = {name: getattr(c10d, name) for name in names}
        self.depth = 0  # send() may call isend() inside: log the outermost call only
        for name, original in self.saved.items():
            def logged(*args, _original=original, _name=name, **kwargs):
                if self.depth == 0:
                    library = _library_caller(sys._getframe(1))
                    if library is not None or _name not in ("isend", "send"):
                        self.delegated.append((len(self.sent),
                                               library or f"torch.distributed.{_name}"))
                    else:
                        tensor = args[0] if args else kwargs["tensor"]
                        # newer torch also names the peer group_dst (a rank inside the group)
                        dst = args[1] if len(args) > 1 else kwargs.get(
                            "dst", kwargs.get("group_dst"))
                        # a copy: the sender may reuse or overwrite its buffer after the call
                        self.sent.append((int(dst), tensor.detach().clone()))
                self.depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.depth -= 1

            # both names: code may call dist.isend or reach c10d's own
            setattr(c10d, name, logged)
            setattr(dist, name, logged)
        return self.sent

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self.saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
