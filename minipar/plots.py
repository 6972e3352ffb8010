"""Static pictures of a Timeline (a Gantt chart per rank and where the time went) and of
memory by kind (stacked bars).

Pure functions (a Timeline in, a matplotlib Figure or PNG bytes out; no pyplot
state, no ipywidgets), so the tour and the benchmarks save them as files, tests
call them without a browser, and the widgets reuse them.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .trace import Timeline

# Fixed colours for the kinds every lesson uses; other kinds take the next free colour.
KIND_COLORS = {
    "compute": "#4C72B0", "forward": "#4C72B0", "F": "#4C72B0",
    "backward": "#55A868", "B": "#55A868", "I": "#8FBF7F", "W": "#2E7D32",
    "send": "#DD8452", "recv": "#C44E52", "wait": "#B0B0B0", "barrier": "#B0B0B0",
    "extra": "#DA8BC3",
    "all_reduce": "#8172B3", "comm": "#8172B3", "collective": "#8172B3",
}


MEMORY_KINDS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868",
                "activations": "#C44E52"}


def memory_total(row: dict) -> float:
    """Bytes over every kind of MEMORY_KINDS a row holds (missing kinds count 0)."""
    return sum(row.get(kind, 0.0) for kind in MEMORY_KINDS)


def stack_memory(ax, rows: list[dict], names: list[str], scale: float = 2**20) -> None:
    """One stacked bar per row: its bytes by kind (divided by `scale`), bottom to top."""
    bottom = [0.0] * len(rows)
    for kind, color in MEMORY_KINDS.items():
        values = [r.get(kind, 0.0) / scale for r in rows]
        if any(values):
            ax.bar(names, values, bottom=bottom, color=color, label=kind)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]


_SPARE = ["#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD", "#1B9E77", "#D95F02"]


def kind_colors(timeline: Timeline) -> dict[str, str]:
    """A colour for every kind in the timeline, stable for the same set of kinds."""
    colors, spare = {}, iter(_SPARE * 4)
    for kind in sorted({e.kind for e in timeline}):
        colors[kind] = KIND_COLORS.get(kind) or next(spare)
    return colors


def render_timeline(timeline: Timeline, upto: float | None = None, title: str = "",
                    width: float = 9.0, ax=None) -> Figure:
    """A Gantt chart: one row per rank, compute on top, communication in a thin strip below.

    `upto` (seconds) draws only what had started by then, clipped, with a cursor:
    scrubbing it from 0 to the makespan replays the run.
    """
    ranks = timeline.ranks
    if ax is None:
        fig = Figure(figsize=(width, 0.55 * max(len(ranks), 1) + 1.2), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    colors = kind_colors(timeline)
    t0, span = timeline.start, timeline.makespan or 1.0
    for e in timeline:
        if upto is not None and e.start - t0 > upto:
            continue
        end = e.end if upto is None else min(e.end, t0 + upto)
        row = ranks.index(e.rank)
        top, height = (row - 0.4, 0.55) if e.track == "compute" else (row + 0.18, 0.22)
        ax.broken_barh([((e.start - t0) * 1e3, (end - e.start) * 1e3)], (top, height),
                       facecolors=colors[e.kind], edgecolor="white", linewidth=0.5)
        if e.track == "compute" and (end - e.start) > 0.06 * span and e.label:
            ax.text((e.start - t0 + (end - e.start) / 2) * 1e3, top + height / 2, e.label,
                    ha="center", va="center", fontsize=7, color="white", clip_on=True)
    if upto is not None:
        ax.axvline(upto * 1e3, color="black", linewidth=1)
    ax.set_xlim(0, span * 1e3 * 1.02)
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"{len(timeline)} events, makespan {span * 1e3:.1f} ms", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


def render_summary(timeline: Timeline, title: str = "where the time went") -> Figure:
    """Stacked bars per rank: compute, communication and idle time over the makespan."""
    s = timeline.summary()
    fig = Figure(figsize=(6, 0.5 * len(s.busy) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    rows = range(len(s.busy))
    other = [max(s.makespan - b - c, 0.0) for b, c in zip(s.busy, s.comm, strict=True)]
    left = [0.0] * len(s.busy)
    for values, label, color in ((s.busy, "compute", "#4C72B0"), (s.comm, "communication",
                                 "#8172B3"), (other, "idle", "#DDDDDD")):
        ax.barh(rows, [v * 1e3 for v in values], left=[x * 1e3 for x in left], color=color,
                label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_yticks(list(rows), [f"rank {r}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title} (bubble {s.bubble_fraction:.0%})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


def to_png(fig: Figure, dpi: int = 100) -> bytes:
    """PNG bytes of a figure (what widgets display and files store)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def to_svg(fig: Figure) -> str:
    """The figure as an SVG document (text kept as text, so it stays crisp at any width
    and needs no fonts of its own): what the browser-drawn widgets display."""
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "minipar"}):
        fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg"):]
