"""Pictures of a device mesh and of the planner's ranking (pure: data in, Figure out).

`render_mesh` draws every rank as a box: the last (fastest) dimension side by side
inside a cell, the one before it as columns, the rest as rows, so `Mesh(dp=2, pp=2,
tp=2)` reads as dp replicas (rows) x pipeline stages (columns) x tensor shards. Each box
says what that rank holds. `render_plans` draws the planner's best configurations as
stacked step-time bars beside their memory.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from minipar.cost import GB
from minipar.mesh import Mesh
from minipar.mesh.planner import Hardware, Plan

DIM_COLORS = {"dp": "#4C72B0", "pp": "#DD8452", "tp": "#55A868", "ep": "#8172B3"}
_OTHER = ["#C44E52", "#937860", "#64B5CD", "#CCB974"]
STEP_COLORS = {"compute": "#4C72B0", "bubble": "#B0B0B0", "tp": "#55A868", "pp": "#DD8452",
               "dp": "#8172B3", "optimizer": "#CCB974", "sharing cores": "#C44E52"}


def dim_color(mesh: Mesh, name: str) -> str:
    """Each dimension's colour: fixed for dp, pp, tp and ep, the next spare otherwise."""
    spare = iter(_OTHER)
    for n in mesh.names:
        color = DIM_COLORS.get(n) or next(spare)
        if n == name:
            return color
    raise ValueError(f"dimension must be one of {mesh.names}; got {name!r}")


def holds(mesh: Mesh, rank: int, layers: int = 8, experts: int = 8) -> str:
    """What `rank` holds, in words: its stage's layers (pp), its slice of every split
    matrix (tp), its experts (ep) and its part of the batch (dp)."""
    c, parts = mesh.coords(rank), []
    if "pp" in c:
        per = layers / mesh["pp"]
        first, last = math.floor(c["pp"] * per), math.floor((c["pp"] + 1) * per) - 1
        parts.append(f"layers {first}-{last}" if last > first else f"layer {first}")
    if "tp" in c and mesh["tp"] > 1:
        parts.append(f"{c['tp'] + 1}/{mesh['tp']} of each matrix")
    if "ep" in c:
        per = experts // mesh["ep"]
        parts.append(f"experts {c['ep'] * per}-{(c['ep'] + 1) * per - 1}")
    if "dp" in c and mesh["dp"] > 1:
        parts.append(f"batch part {c['dp'] + 1}/{mesh['dp']}")
    return "\n".join(parts) or "everything"


def mesh_layout(mesh: Mesh) -> dict[int, tuple[float, float]]:
    """Each rank's (x, y) cell corner: last dimension side by side within a column, the
    one before it as columns, every other dimension flattened into rows."""
    inner = mesh.shape[-1]
    cols = mesh.shape[-2] if len(mesh.shape) > 1 else 1
    where = {}
    for r in range(mesh.size):
        row, rest = divmod(r, inner * cols)
        col, within = divmod(rest, inner)
        where[r] = (col * (inner + 0.6) + within, -row * 1.35)
    return where


def render_mesh(mesh: Mesh, selected: int | None = None, colour_by: str | None = None,
                layers: int = 8, experts: int = 8) -> Figure:
    """Every rank as a box saying what it holds, filled by its group along `colour_by`
    (ranks of one group share a shade). With a `selected` rank, its box is outlined and
    each rank it shares a group with wears that dimension's tag."""
    colour_by = colour_by or mesh.names[-1]
    where = mesh_layout(mesh)
    width = max(x for x, _ in where.values()) + 1
    rows = round(-min(y for _, y in where.values()) / 1.35) + 1
    fig = Figure(figsize=(min(2 + 1.45 * width, 13), 0.7 + 1.45 * rows), layout="constrained")
    ax = fig.subplots()
    groups = mesh.groups(colour_by)
    index = {r: i for i, g in enumerate(groups) for r in g}
    base = dim_color(mesh, colour_by)
    mine = {n: set(mesh.group_of(n, selected)) for n in mesh.names} if selected is not None \
        else {}
    for r, (x, y) in where.items():
        shade = 0.25 + 0.55 * (index[r] / max(len(groups) - 1, 1))
        faded = selected is not None and r not in mine.get(colour_by, ())
        ax.add_patch(FancyBboxPatch((x + 0.05, y + 0.05), 0.9, 1.1,
                                    boxstyle="round,pad=0.02,rounding_size=0.08",
                                    facecolor=base, alpha=0.15 if faded else shade,
                                    edgecolor="black" if r == selected else "#888888",
                                    linewidth=2.5 if r == selected else 0.8))
        ax.text(x + 0.5, y + 1.0, f"rank {r}", ha="center", va="center", fontsize=10,
                fontweight="bold")
        coords = " ".join(f"{n}{v}" for n, v in mesh.coords(r).items())
        ax.text(x + 0.5, y + 0.82, coords, ha="center", va="center", fontsize=7.5,
                color="#333333")
        ax.text(x + 0.5, y + 0.5, holds(mesh, r, layers, experts), ha="center", va="center",
                fontsize=6.5, linespacing=1.15)
        tags = [n for n in mesh.names if r != selected and r in mine.get(n, ())]
        for i, n in enumerate(tags):
            tx = x + 0.5 + (i - (len(tags) - 1) / 2) * 0.28
            ax.text(tx, y + 0.17, n, ha="center", va="center", fontsize=7, color="white",
                    fontweight="bold", bbox=dict(boxstyle="round,pad=0.15",
                                                 facecolor=dim_color(mesh, n), linewidth=0))
    inner = mesh.shape[-1]
    if len(mesh.names) > 1:  # name the columns and the rows by their coordinates
        for col in range(mesh.shape[-2]):
            ax.text(col * (inner + 0.6) + inner / 2, 1.3, f"{mesh.names[-2]} = {col}",
                    ha="center", va="center", fontsize=9, color=dim_color(mesh, mesh.names[-2]),
                    fontweight="bold")
        if len(mesh.names) > 2:
            for row in range(rows):
                c = mesh.coords(row * inner * mesh.shape[-2])
                label = "\n".join(f"{n} = {c[n]}" for n in mesh.names[:-2])
                ax.text(-0.15, -row * 1.35 + 0.6, label, ha="right", va="center", fontsize=9,
                        color=dim_color(mesh, mesh.names[0]), fontweight="bold")
    ax.set_xlim(-0.9 if len(mesh.names) > 2 else -0.1, width + 0.1)
    ax.set_ylim(-(rows - 1) * 1.35 - 0.1, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")
    title = f"{mesh}: shaded by {colour_by} group"
    if selected is not None:
        title += f"; rank {selected}'s groups tagged"
    ax.set_title(title, fontsize=10)
    return fig


def render_plans(plans: list[Plan], cluster: Hardware, title: str = "") -> Figure:
    """The planner's configurations, fastest at the top: each step's time stacked by where
    it goes, and beside it the memory on the fullest device against the device's."""
    if not plans:
        raise ValueError("plans must hold at least one Plan (nothing fits? say so instead)")
    fig = Figure(figsize=(11, 1.2 + 0.36 * len(plans)), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 1.2], sharey=True)
    ys = list(range(len(plans)))[::-1]
    for kind, color in STEP_COLORS.items():
        starts = [sum(v for k, v in p.seconds.items() if list(STEP_COLORS).index(k) <
                      list(STEP_COLORS).index(kind)) for p in plans]
        values = [p.seconds.get(kind, 0.0) for p in plans]
        if any(values):
            left.barh(ys, values, left=starts, color=color, label=kind, height=0.7)
    for y, p in zip(ys, plans, strict=True):
        left.text(p.step, y, f" {p.step:.2f} s, {p.share_of_peak:.0%} of peak", va="center",
                  fontsize=7.5, fontweight="bold" if p is plans[0] else "normal")
    left.set_yticks(ys, [("\u2605 " if p is plans[0] else "") + p.label.replace(
        " recompute=", " rc=") for p in plans], fontsize=7.5)
    left.get_yticklabels()[0].set_fontweight("bold")
    left.set_xlim(0, max(p.step for p in plans) * 1.3)
    left.set_xlabel("seconds per step (estimate)")
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", fontsize=7.5,
               ncol=len(STEP_COLORS), frameon=False)
    left.set_title(title, fontsize=9, loc="left")
    memory = [p.memory / GB for p in plans]
    right.barh(ys, memory, color=["#C44E52" if m > cluster.memory_bytes / GB else "#4C72B0"
                                  for m in memory], height=0.7)
    right.axvline(cluster.memory_bytes / GB, color="black", linestyle="--", linewidth=1)
    right.set_xlim(0, max(max(memory), cluster.memory_bytes / GB) * 1.1)
    right.text(cluster.memory_bytes / GB, ys[-1] - 0.5, f"{cluster.memory_bytes / GB:.0f} GB ",
               ha="right", va="center", fontsize=7)
    right.set_xlabel("GB on the fullest device")
    return fig
