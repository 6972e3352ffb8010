"""What a run can end with: results in rank order, or an error naming the rank."""

from __future__ import annotations

from .. import trace


class RankError(RuntimeError):
    """A rank raised (or died); carries the rank and its remote traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        text = f"rank {rank} {message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RankTimeout(TimeoutError):
    """No rank made progress for `timeout` seconds (runtime/progress.py: no message,
    collective, recorded computation or step); `waiting` maps each unfinished rank to
    where it was."""

    def __init__(self, timeout: float, waiting: dict[int, str]) -> None:
        self.timeout, self.waiting = timeout, waiting
        lines = [f"no rank made progress for {timeout:g}s (timeout={timeout:g}); "
                 f"{len(waiting)} rank(s) were still waiting (a deadlock, or one operation "
                 "longer than that):"]
        lines += [f"  rank {r}: {where}" for r, where in sorted(waiting.items())]
        lines.append("If one step is just that slow, pass a larger timeout=.")
        super().__init__("\n".join(lines))

    def one_line(self, flag: str = "--timeout") -> str:
        """The command line's form: the first rank, where it waited, the flag to change."""
        r = min(self.waiting) if self.waiting else 0
        where = self.waiting.get(r, "still running")
        return (f"no rank made progress for {self.timeout:g}s: rank {r} waited {where} "
                f"({len(self.waiting)} rank(s) stuck); a deadlock, or one operation longer "
                f"than that: pass a larger {flag}")


class RankDied:
    """In place of a result: this rank's process died before returning (a run started
    with tolerate_deaths=True goes on without it)."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.rank, self.exitcode = rank, exitcode

    def __repr__(self) -> str:
        return f"RankDied(rank={self.rank}, exitcode={self.exitcode})"


class Results(list):
    """Per-rank return values in rank order; `.timeline` and `.outputs` tell what happened."""

    timeline: trace.Timeline
    outputs: list[str]
    seconds: float
