"""Time spans: where a rank's time went. Lengths of unions, differences and overlaps of
intervals (a rank's compute, its communication, what one hides of the other), and the
Summary a Timeline gives of them (trace.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Where the time went, per rank: computing, communicating, or idle."""

    makespan: float
    busy: list[float]
    comm: list[float]
    idle: list[float]
    bubble_fraction: float

    def __str__(self) -> str:
        rows = [f"makespan {self.makespan * 1e3:.1f} ms, "
                f"bubble (share of rank-time not computing) {self.bubble_fraction:.1%}"]
        for r, (b, c, i) in enumerate(zip(self.busy, self.comm, self.idle, strict=True)):
            rows.append(f"  rank {r}: compute {b * 1e3:7.1f} ms  comm {c * 1e3:7.1f} ms"
                        f"  idle {i * 1e3:7.1f} ms")
        return "\n".join(rows)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals, counting overlaps once (nested spans)."""
    return sum(end - start for start, end in merged_intervals(intervals))


def merged_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same cover as disjoint intervals, in order (touching ones joined)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        # sorted by start, so an interval overlaps (or touches) only the last merged one
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]
             ) -> list[tuple[float, float]]:
    """The parts of intervals `a` that no interval of `b` covers."""
    out, cuts = [], merged_intervals(b)
    for start, end in merged_intervals(a):
        for cut_start, cut_end in cuts:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            # cuts are sorted and disjoint: what is left of this interval starts after the cut
            start = max(start, cut_end)
        if start < end:
            out.append((start, end))
    return out


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both sets of intervals."""
    a, b = merged_intervals(a), merged_intervals(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        # advance whichever interval ends first: it cannot overlap anything later in the other list
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
