"""Pure renderers: a Timeline (or data) in, a matplotlib Figure or PNG bytes out.

No ipywidgets and no pyplot state here, so tests call them without a browser and
lessons can show a static picture where no kernel runs.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minipar.trace import Timeline

# Fixed colours for the kinds every lesson uses; other kinds take the next free colour.
KIND_COLORS = {
    "compute": "#4C72B0", "forward": "#4C72B0", "F": "#4C72B0",
    "backward": "#55A868", "B": "#55A868", "I": "#8FBF7F", "W": "#2E7D32",
    "send": "#DD8452", "recv": "#C44E52", "wait": "#B0B0B0", "barrier": "#B0B0B0",
    "extra": "#DA8BC3",
    "all_reduce": "#8172B3", "comm": "#8172B3", "collective": "#8172B3",
}
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
    ax.legend(fontsize=7, loc="lower right")
    return fig


def to_png(fig: Figure, dpi: int = 100) -> bytes:
    """PNG bytes of a figure (what widgets display and files store)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def render_speedup(rows: list[dict], title: str = "") -> Figure:
    """Measured speedup vs ranks beside the ideal and the model, and where each rank's
    step time went (compute / communication not hidden / idle)."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    ranks = [r["ranks"] for r in rows]
    left.plot(ranks, ranks, color="#B0B0B0", linestyle="--", label="ideal")
    left.plot(ranks, [r["model_speedup"] for r in rows], color="black", linewidth=1,
              label="alpha-beta model")
    left.plot(ranks, [r["speedup"] for r in rows], marker="o", color="#4C72B0",
              label="measured")
    left.set_xticks(ranks)
    left.set_xlabel("ranks")
    left.set_ylabel("speedup (samples/s vs 1 rank)")
    left.legend(fontsize=8)
    left.set_title(title, fontsize=9)
    bottom = [0.0] * len(rows)
    for key, color in (("compute", "#4C72B0"), ("comm", "#8172B3"), ("idle", "#DDDDDD")):
        values = [r[key] * 1e3 for r in rows]
        right.bar([str(k) for k in ranks], values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_xlabel("ranks")
    right.set_ylabel("ms per step, per rank")
    right.set_title("where a step goes (from the Timeline)", fontsize=9)
    right.legend(fontsize=8)
    return fig


def render_pipeline(ideal: Timeline, measured: Timeline | None = None, upto: float | None = None,
                    split_backward: bool = False, title: str = "") -> Figure:
    """The simulated schedule as a Gantt (and the measured run under it, on its own time
    axis), with the micro-batches each rank holds activations for over time."""
    from minipar.pipeline import in_flight_over_time

    panels = 3 if measured is not None else 2
    ranks = max(len(ideal.ranks), 1)
    fig = Figure(figsize=(10, 0.45 * ranks * (panels - 1) + 2.6), layout="constrained")
    axes = fig.subplots(panels, 1, height_ratios=[ranks] * (panels - 1) + [max(ranks * 0.7, 2)])
    bubble = ideal.summary(ranks).bubble_fraction
    render_timeline(ideal, upto=upto, ax=axes[0],
                    title=title or f"ideal (simulated): bubble {bubble:.1%}")
    if measured is not None:
        real = Timeline(e for e in measured if e.kind in ("F", "B", "I", "W", "recv", "send"))
        got = real.summary(ranks).bubble_fraction
        render_timeline(real, ax=axes[1], title=f"measured on real ranks: bubble {got:.1%}")
    curve_ax = axes[-1]
    for rank, points in in_flight_over_time(ideal, split_backward).items():
        xs = [p[0] * 1e3 for p in points if upto is None or p[0] <= upto]
        ys = [p[1] for p in points if upto is None or p[0] <= upto]
        curve_ax.step(xs, ys, where="post", label=f"rank {rank}")
    curve_ax.set_xlim(0, ideal.makespan * 1e3 * 1.02)
    curve_ax.set_ylabel("activations held")
    curve_ax.set_xlabel("time (ms)")
    curve_ax.legend(fontsize=7, ncol=min(ranks, 4))
    return fig
