"""Ring attention, step by step: who holds which queries and which key/value block, which
parts of the score matrix each rank has computed (the causal mask's skipped blocks
greyed), and each rank's work so far. `render_ring` is pure; `RingAnimator` animates it."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minipar.context_parallel import ring_plan

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
               "#8C8C8C"]
SKIPPED, FUTURE = "#E6E6E6", "#FFFFFF"


def render_ring(world_size: int, step: int, causal: bool = True, balanced: bool = True
                ) -> Figure:
    """Left: the score matrix (queries down, keys across, the sequence in 2K chunks), each
    cell coloured by the rank that computed it up to `step` (the current step's cells
    outlined), skipped cells grey and hatched. Middle: what each rank holds at `step`.
    Right: score cells each rank has computed so far."""
    if world_size > len(RANK_COLORS):
        raise ValueError(f"world_size must be at most {len(RANK_COLORS)} to draw; got "
                         f"{world_size}")
    plan = ring_plan(world_size, causal, balanced)
    if not 0 <= step < world_size:
        raise ValueError(f"step must be in 0..{world_size - 1}; got {step}")
    n = 2 * world_size
    fig = Figure(figsize=(11, 3.9), layout="constrained")
    grid, holds, bars = fig.subplots(1, 3, width_ratios=[1.15, 0.9, 1])
    for s in range(step + 1):
        for r, row in enumerate(plan[s]):
            for qc, kc, done in row["cells"]:
                color = RANK_COLORS[r] if done else SKIPPED
                grid.add_patch(Rectangle((kc, qc), 1, 1, facecolor=color,
                                         alpha=1.0 if s == step or not done else 0.45,
                                         hatch=None if done else "///", edgecolor="white",
                                         linewidth=1))
                if s == step:
                    grid.add_patch(Rectangle((kc + 0.04, qc + 0.04), 0.92, 0.92, fill=False,
                                             edgecolor="black", linewidth=1.4))
    grid.set_xlim(0, n)
    grid.set_ylim(n, 0)
    grid.set_aspect("equal")
    grid.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    grid.set_yticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    grid.set_xlabel("key chunk")
    grid.set_ylabel("query chunk")
    grid.set_title(f"scores computed up to step {step} (current step outlined)", fontsize=9)
    grid.legend(handles=[Patch(facecolor=SKIPPED, hatch="///", label="skipped: masked")],
                loc="upper left", bbox_to_anchor=(0, -0.13), fontsize=7, frameon=False)

    holds.axis("off")
    holds.set_xlim(0, 1)
    holds.set_ylim(world_size + 0.6, -0.4)
    holds.set_title(f"step {step}: what each rank holds", fontsize=9)
    for r, row in enumerate(plan[step]):
        own = sorted({qc for qc, _, _ in row["cells"]})
        theirs = sorted({kc for _, kc, _ in row["cells"]})
        skipped = sum(not done for *_, done in row["cells"])
        holds.text(0.0, r, f"rank {r}", color=RANK_COLORS[r], fontweight="bold", fontsize=9,
                   va="center")
        holds.text(0.22, r, f"Q chunks {own}\nKV of rank {row['src']}: chunks {theirs}"
                   + (f"\n{skipped} cell(s) skipped" if skipped else ""), fontsize=7.5,
                   va="center")
    holds.text(0.0, world_size + 0.2, "next: each KV block moves to rank r+1", fontsize=7.5,
               color="#555555")

    work = [sum(done for s in range(step + 1) for *_, done in plan[s][r]["cells"])
            for r in range(world_size)]
    total = [sum(done for s in range(world_size) for *_, done in plan[s][r]["cells"])
             for r in range(world_size)]
    names = [f"rank {r}" for r in range(world_size)]
    bars.barh(names, total, color="#EEEEEE", edgecolor="#BBBBBB", label="by the last step")
    bars.barh(names, work, color=RANK_COLORS[:world_size], label="so far")
    bars.invert_yaxis()
    bars.set_xlim(0, max(total) * 1.15)
    bars.set_xlabel("score cells computed")
    bars.xaxis.get_major_locator().set_params(integer=True)  # a count: no 2.5
    layout = "balanced (zig-zag)" if balanced else "contiguous"
    bars.set_title(f"work per rank, {layout}, {'causal' if causal else 'no mask'}\n"
                   f"busiest / idlest rank: {max(total) / min(total):.2f}", fontsize=9)
    bars.legend(fontsize=7, loc="lower right")
    return fig
