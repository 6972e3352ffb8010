"""Pure renderers of the widgets' own pictures: the speedup lab's curves, the pipeline
explorer's schedule with activations held over time, schedules side by side, and an
all-to-all's traffic matrix. A Timeline's Gantt chart and
summary bars come from `minipar.plots`, which the library itself uses too.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from minipar.pipeline import in_flight_over_time
from minipar.plots import memory_total, render_timeline, stack_memory
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
                    title: str = "",
                    predicted: Timeline | None = None) -> Figure:
    """The simulated schedule as a Gantt, with the micro-batches each rank holds
    activations for over time; with a measured run, also the simulator's prediction from
    that run's own costs (messages and engine overhead included) and the run itself,
    those two on one time axis so they compare bar for bar."""
    extra = [t for t in (predicted, measured) if t is not None]
    panels = 2 + len(extra)
    ranks = max(len(ideal.ranks), 1)
    fig = Figure(figsize=(10, 0.45 * ranks * (panels - 1) + 2.6), layout="constrained")
    axes = fig.subplots(panels, 1, height_ratios=[ranks] * (panels - 1) + [max(ranks * 0.7, 2)])
    bubble = ideal.summary(ranks).bubble_fraction
    render_timeline(ideal, upto=upto, ax=axes[0],
                    title=title or f"ideal (simulated): bubble {bubble:.1%}")
    runs, shared = compared_runs(predicted, measured, ranks)
    for ax, (label, real) in zip(axes[1:], runs, strict=False):
        render_timeline(real, ax=ax, title=label)
        ax.set_xlim(0, shared)
    curve_ax = axes[-1]
    for rank, points in in_flight_over_time(ideal).items():
        xs = [p[0] * 1e3 for p in points if upto is None or p[0] <= upto]
        ys = [p[1] for p in points if upto is None or p[0] <= upto]
        curve_ax.step(xs, ys, where="post", label=f"rank {rank}")
    curve_ax.set_xlim(0, ideal.makespan * 1e3 * 1.02)
    curve_ax.set_ylabel("activations held")
    curve_ax.yaxis.get_major_locator().set_params(integer=True)  # a count: no 2.5
    curve_ax.set_xlabel("time (ms)")
    curve_ax.legend(fontsize=7, ncol=min(ranks, 4))
    return fig


def compared_runs(predicted: Timeline | None, measured: Timeline | None, ranks: int
                  ) -> tuple[list[tuple[str, Timeline]], float]:
    """The prediction and the measured run as the pipeline pictures show them: only the
    schedule's actions and messages, each titled with its bubble and step time, and the
    one time axis (ms) they share so they compare bar for bar."""
    runs = []
    for name, timeline in (("predicted from the measured costs", predicted),
                           ("measured on real ranks", measured)):
        if timeline is not None:
            real = Timeline(e for e in timeline if e.kind in ("F", "B", "I", "W", "recv", "send"))
            runs.append((f"{name}: bubble {real.summary(ranks).bubble_fraction:.1%}, step "
                         f"{real.makespan * 1e3:.0f} ms", real))
    return runs, max((t.makespan for _, t in runs), default=0.0) * 1e3 * 1.02


def render_schedule_gallery(timelines: list[tuple[str, Timeline]]) -> Figure:
    """Several simulated schedules stacked on one time axis, each titled with its bubble:
    the static picture to compare schedules by eye (same costs, same scale)."""
    if not timelines:
        raise ValueError("timelines must name at least one (title, Timeline) pair")
    rows = [max(len(t.ranks), 1) for _, t in timelines]
    fig = Figure(figsize=(10, 0.42 * sum(rows) + 0.9 * len(rows)), layout="constrained")
    axes = fig.subplots(len(timelines), 1, height_ratios=rows, squeeze=False)[:, 0]
    longest = max(t.makespan for _, t in timelines) * 1e3 * 1.02
    for ax, (title, timeline) in zip(axes, timelines, strict=True):
        bubble = timeline.summary(len(timeline.ranks)).bubble_fraction
        render_timeline(timeline, ax=ax, title=f"{title}: bubble {bubble:.1%}")
        ax.set_xlim(0, longest)
        if ax is not axes[-1]:
            ax.set_xlabel("")
    return fig


def render_all_to_all(send_counts: list[list[int]], title: str = "") -> Figure:
    """An all-to-all as a K x K grid: cell (i, j) is what rank i sends to rank j (the
    diagonal stays home), with each rank's total sent and received beside it."""
    k = len(send_counts)
    if k == 0 or any(len(row) != k for row in send_counts):
        raise ValueError(f"send_counts must be a square K x K list; got {send_counts!r}")
    fig = Figure(figsize=(8.5, 3.4), layout="constrained")
    grid, bars = fig.subplots(1, 2, width_ratios=[1, 1.3])
    grid.imshow(send_counts, cmap="Blues", vmin=0)
    peak = max(max(row) for row in send_counts) or 1
    for i, row in enumerate(send_counts):
        for j, n in enumerate(row):
            grid.text(j, i, str(n), ha="center", va="center", fontsize=9,
                      color="white" if n > 0.6 * peak else "black",
                      fontweight="bold" if i != j else "normal")
    grid.set_xticks(range(k), [f"to {j}" for j in range(k)])
    grid.set_yticks(range(k), [f"rank {i}" for i in range(k)])
    grid.set_title("rows rank i sends to rank j", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    sent = [sum(row) - row[i] for i, row in enumerate(send_counts)]
    received = [sum(send_counts[i][j] for i in range(k)) - send_counts[j][j] for j in range(k)]
    stays = [send_counts[i][i] for i in range(k)]
    width = 0.27
    for offset, values, label, color in ((-width, stays, "stays on the rank", "#B0B0B0"),
                                         (0, sent, "sent to others", "#4C72B0"),
                                         (width, received, "received from others", "#DD8452")):
        bars.bar([r + offset for r in range(k)], values, width, label=label, color=color)
    bars.set_xticks(range(k), [f"rank {r}" for r in range(k)])
    bars.set_ylabel("rows")
    bars.yaxis.get_major_locator().set_params(integer=True)
    bars.set_ylim(0, max(sent + received + stays) * 1.4)  # headroom: the legend sits above
    bars.legend(fontsize=7, ncol=3, loc="upper center", frameon=False)
    bars.set_title("per rank: kept at home, sent, received", fontsize=9)
    return fig


STAGE_NAMES = ("data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def render_memory(formula: list[dict], measured: list[dict] | None = None,
                  device_bytes: float | None = None, title: str = "") -> Figure:
    """Bytes per rank by kind for each ZeRO stage (rows with "stage" and a key per kind),
    stacked; `measured` rows (with `formula_*` keys) get a second panel, measured bars
    beside the formula's outlines; `device_bytes` draws the device's memory as a line."""
    panels = 2 if measured else 1
    fig = Figure(figsize=(10 if measured else 6.5, 3.4), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    scale, unit = (1e9, "GB") if max(map(memory_total, formula)) > 1e9 else (2**20, "MiB")
    stack_memory(axes[0], formula, [STAGE_NAMES[r["stage"]] for r in formula], scale)
    axes[0].set_ylabel(f"{unit} per rank")
    axes[0].set_title(title or "ZeRO's formula", fontsize=9)
    if device_bytes:
        axes[0].axhline(device_bytes / scale, color="black", linestyle="--", linewidth=1)
        axes[0].text(len(formula) - 0.5, device_bytes / scale, " device memory", fontsize=7,
                     va="bottom", ha="right")
    axes[0].legend(fontsize=7, loc="upper right")
    if measured:
        stack_memory(axes[1], measured, [STAGE_NAMES[r["stage"]] for r in measured])
        for i, r in enumerate(measured):
            want = memory_total({k[len("formula_"):]: v for k, v in r.items()
                                 if k.startswith("formula_")})
            axes[1].hlines(want / 2**20, i - 0.4, i + 0.4, color="black", linewidth=2)
        axes[1].set_ylabel("MiB on rank 0")
        axes[1].set_title("measured on CPU ranks (black line: formula)", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    return fig


def render_lifecycle(moments: list, title: str = "") -> Figure:
    """FSDP's step as a grid (`sharded.unit_lifecycle`): one row per unit, one column per
    moment; a dark cell is a unit whole at that moment, a light one its 1/K slice at
    rest, the acting unit's cell is outlined, and the bottom row counts the whole units."""
    from matplotlib.patches import Rectangle

    units = 1 + max(m.unit for m in moments if m.unit is not None)
    colors = {"gather": "#4C72B0", "free": "#8C8C8C", "forward": "#55A868",
              "backward": "#DD8452", "reduce-scatter": "#C44E52", "step": "#8172B3"}
    fig = Figure(figsize=(max(6.0, 0.42 * len(moments) + 1.5), 0.55 * units + 2.2),
                 layout="constrained")
    ax = fig.add_subplot()
    for col, m in enumerate(moments):
        for u in range(units):
            held = u in m.whole
            acting = m.unit == u or m.unit is None
            ax.add_patch(Rectangle((col, u), 0.92, 0.85, facecolor="#2F4B7C" if held
                                   else "#E3E8F0", edgecolor=colors[m.action] if acting
                                   else "white", linewidth=2.2 if acting else 0.5))
        ax.text(col + 0.46, units + 0.45, str(len(m.whole)), ha="center", va="center",
                fontsize=8)
    ax.text(-0.2, units + 0.45, "units whole", ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.1, len(moments))
    ax.set_ylim(units + 0.9, -0.1)
    ax.set_yticks([u + 0.42 for u in range(units)], [f"unit {u}" for u in range(units)],
                  fontsize=8)
    # the moments name the columns from above, as tick labels, so that the layout leaves
    # them exactly the room they need
    ax.xaxis.tick_top()
    ax.set_xticks([col + 0.46 for col in range(len(moments))], [m.label for m in moments],
                  rotation=60, ha="left", rotation_mode="anchor", fontsize=7)
    for m, label in zip(moments, ax.get_xticklabels(), strict=True):
        label.set_color(colors[m.action])
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or "dark: the unit's whole parameters; light: only this rank's slice",
                 fontsize=9, pad=2)
    return fig
