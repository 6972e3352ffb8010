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
    """A run passed its timeout; `waiting` maps each unfinished rank to where it was."""

    def __init__(self, timeout: float, waiting: dict[int, str]) -> None:
        self.waiting = waiting
        lines = [f"run did not finish within timeout={timeout:g}s; "
                 f"{len(waiting)} rank(s) were still waiting (a deadlock or a slow rank):"]
        lines += [f"  rank {r}: {where}" for r, where in sorted(waiting.items())]
        lines.append("If the run is just slow, pass a larger timeout=.")
        super().__init__("\n".join(lines))


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
