"""What every exercise check shares: running the learner's function on real ranks
and turning a crash, a missing answer or a deadlock into a hint.

Each technique's `exercises.py` holds its lesson's checks; they run the learner's
function on real ranks against a single-process reference and raise
`ExerciseError` saying what is wrong, rank by rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .runtime import RankError, RankTimeout, launch


class ExerciseError(AssertionError):
    """The learner's function ran but gave a wrong answer; the message says where."""


def refuse_library(name: str, fn: object) -> None:
    """A learner who passes minipar's own implementation (or torch's) has not written the
    exercise: say so instead of grading it."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(inner, "__module__", "") or ""
    if module.startswith(("minipar.", "torch.")):
        raise ExerciseError(f"{name}: that is {module}.{getattr(inner, '__qualname__', inner)}, "
                            "the library's own implementation; write your own in the cell above "
                            "(you may call minipar's send/recv and torch.distributed inside it).")


def run_on_ranks(name: str, fn: Callable, world_size: int, *args, timeout: float = 30) -> list:
    try:
        return launch(fn, world_size, *args, backend="gloo", timeout=timeout)
    except RankError as err:
        if "NotImplementedError" in str(err):
            raise ExerciseError(f"{name}: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        text = str(err).lower()
        if any(words in text for words in ("size mismatch", "match expected size", "dtype",
                                           "expected scalar type")):
            raise ExerciseError(
                f"{name}: rank {err.rank} sent or received a tensor whose size or dtype does not "
                "match its peer's. Allocate receive buffers like what is sent "
                "(torch.empty_like(tensor)), and keep one dtype: the data here is float64, and "
                f"torch.empty(n) is float32. ({str(err).splitlines()[0]})") from None
        raise
    except RankTimeout as err:
        waits = "; ".join(f"rank {r} {where}" for r, where in sorted(err.waiting.items()))
        raise ExerciseError(
            f"{name} on {world_size} ranks did not finish in {timeout:g}s: a deadlock? {waits}. "
            "A blocking send can wait for its receiver forever: post each step's send and "
            "receive together (dist.batch_isend_irecv, or isend + irecv and wait on both)."
        ) from None


class SendLog:
    """Inside a rank: record every message this rank sends (destination, a copy of the data)."""

    def __enter__(self) -> list[tuple[int, torch.Tensor]]:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.sent: list[tuple[int, torch.Tensor]] = []
        self.saved = {name: getattr(c10d, name) for name in ("isend", "send")}
        self.depth = 0  # send() may call isend() inside: log the outermost call only
        for name, original in self.saved.items():
            def logged(*args, _original=original, **kwargs):
                if self.depth == 0:
                    tensor = args[0] if args else kwargs["tensor"]
                    dst = args[1] if len(args) > 1 else kwargs.get("dst",
                                                                   kwargs.get("group_dst"))
                    self.sent.append((int(dst), tensor.detach().clone()))
                self.depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.depth -= 1

            setattr(c10d, name, logged)
            setattr(dist, name, logged)
        return self.sent

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self.saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
