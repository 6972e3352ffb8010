"""Pure renderers of the widgets' own pictures: the speedup lab's curves and the pipeline
explorer's schedule with activations held over time. A Timeline's Gantt chart and
summary bars come from `minipar.plots`, which the library itself uses too.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from minipar.pipeline import in_flight_over_time
from minipar.plots import render_timeline
from minipar.trace import Timeline


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
