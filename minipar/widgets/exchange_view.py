"""An all-to-all, step by step: every rank's rows as squares coloured by the rank they are
bound for, and the rows sent over each link in the step. Flat (one step) or Tutel's
hierarchical (inside the node, then across). `render_exchange` (one step) and
`render_exchange_strip` (every step, for paper) are pure;
`AllToAllAnimator` animates it."""

from __future__ import annotations

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minipar.moe.hierarchical import exchange_plan

PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
           "#8C8C8C", "#CCB974", "#64B5CD", "#1B9E77", "#D95F02"]


def routed_counts(ranks: int, rows: int = 6, skew: float = 1.0, seed: int = 0
                  ) -> list[list[int]]:
    """counts[s][d]: rows rank s sends to rank d, drawn as a router would make them (rank d's
    experts more popular the larger `skew`)."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.arange(ranks, 0, -1, dtype=torch.float64) ** skew
    return [torch.bincount(torch.multinomial(popularity, rows, replacement=True,
                                             generator=gen), minlength=ranks).tolist()
            for _ in range(ranks)]


def _links(sent: list[list[int]], per_node: int) -> tuple[int, int, int, int]:
    """(messages inside nodes, rows inside, messages across nodes, rows across)."""
    k = len(sent)
    inside = [(s, d) for s in range(k) for d in range(k) if s != d and sent[s][d]
              and s // per_node == d // per_node]
    across = [(s, d) for s in range(k) for d in range(k) if sent[s][d]
              and s // per_node != d // per_node]
    return (len(inside), sum(sent[s][d] for s, d in inside), len(across),
            sum(sent[s][d] for s, d in across))


# What each frame of an exchange shows, by (kind, step).
STEP_NAMES = {("flat", 0): "before", ("flat", 1): "after the exchange",
              ("hierarchical", 0): "before", ("hierarchical", 1): "after step 1, inside nodes",
              ("hierarchical", 2): "after step 2, across nodes"}


def _draw_holds(ax, stages: list[dict], stage: int, nodes: int, per_node: int) -> None:
    """Each rank's rows after `stage` steps, one square per row coloured by its
    destination, on a shaded background per node."""
    k = nodes * per_node
    holds = stages[stage]["holds"]
    tallest = max(max(len(h) for h in s["holds"]) for s in stages)
    for b in range(nodes):
        # the node's label sits inside its box, above the tallest pile
        ax.add_patch(Rectangle((b * per_node - 0.45, -0.6), per_node - 0.1, tallest + 2.3,
                               facecolor="#F2F2F2", edgecolor="#BBBBBB"))
        ax.text(b * per_node + (per_node - 1) / 2, tallest + 0.6, f"node {b}",
                ha="center", va="bottom", fontsize=9, color="#555555")
    side = 0.8
    for r, held in enumerate(holds):
        for i, (_, dst) in enumerate(held):
            ax.add_patch(Rectangle((r - side / 2, i), side, 0.85, facecolor=PALETTE[dst],
                                   edgecolor="white", linewidth=0.6))
    ax.set_xlim(-0.7, k - 0.3)
    ax.set_ylim(-0.8, tallest + 1.9)
    ax.set_xticks(range(k), [f"rank {r}" for r in range(k)], fontsize=8)
    for r, label in enumerate(ax.get_xticklabels()):
        label.set_color(PALETTE[r])  # the key: a square bound for rank r has rank r's colour
    ax.set_yticks([])


def render_exchange_strip(counts: list[list[int]], nodes: int, per_node: int) -> Figure:
    """The static picture, for reading on paper: the flat exchange (before, after) above
    the hierarchical one (before, after the step inside nodes, after the step across)."""
    if nodes * per_node > len(PALETTE):
        raise ValueError(f"at most {len(PALETTE)} ranks can be drawn; got {nodes * per_node}")
    fig = Figure(figsize=(12, 5.6), layout="constrained")
    axes = fig.subplots(2, 3)
    for row, kind in enumerate(("flat", "hierarchical")):
        stages = exchange_plan(counts, nodes, per_node, kind)
        for col, ax in enumerate(axes[row]):
            if col >= len(stages):
                ax.set_visible(False)
                continue
            _draw_holds(ax, stages, col, nodes, per_node)
            sent = stages[col]["sent"]
            crossed = "\n" if sent is None else (
                f"\n{_links(sent, per_node)[2]} messages crossed nodes")
            ax.set_title(f"{kind}: {STEP_NAMES[(kind, col)]}{crossed}", fontsize=9)
    fig.suptitle("an all-to-all of routed rows: squares coloured by the rank they are bound "
                 "for", fontsize=10)
    return fig


def render_exchange(counts: list[list[int]], nodes: int, per_node: int, kind: str,
                    stage: int) -> Figure:
    """Left: each rank's rows after `stage` steps (0 = before), one square per row coloured
    by its destination, nodes shaded. Right: rows sent over each link in that step, with
    the messages and rows that stayed inside a node and those that crossed nodes."""
    stages = exchange_plan(counts, nodes, per_node, kind)
    if not 0 <= stage < len(stages):
        raise ValueError(f"stage must be in 0..{len(stages) - 1} for {kind}; got {stage}")
    k = nodes * per_node
    if k > len(PALETTE):
        raise ValueError(f"at most {len(PALETTE)} ranks can be drawn; got {k}")
    sent = stages[stage]["sent"]
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1.5, 1])
    _draw_holds(left, stages, stage, nodes, per_node)
    left.set_title(f"{kind} all-to-all, {STEP_NAMES[(kind, stage)]}: squares coloured by the rank "
                   "they are bound for", fontsize=9)
    if sent is None:
        right.axis("off")
        right.text(0.5, 0.5, "press play: each rank's rows are still at home",
                   ha="center", va="center", fontsize=9, color="#555555")
        return fig
    darkest = 1.8 * max(max(row) for row in sent)  # keep every cell light enough to read
    right.imshow(sent, cmap="Blues", vmin=0, vmax=darkest)
    for s in range(k):
        for d in range(k):
            if sent[s][d]:
                right.text(d, s, str(sent[s][d]), ha="center", va="center", fontsize=7,
                           color="black" if s // per_node == d // per_node else "#C44E52",
                           fontweight="normal" if s // per_node == d // per_node else "bold")
    for edge in range(per_node, k, per_node):
        right.axhline(edge - 0.5, color="#C44E52", linewidth=1)
        right.axvline(edge - 0.5, color="#C44E52", linewidth=1)
    right.set_xticks(range(k))
    right.set_yticks(range(k))
    right.set_xlabel("to rank")
    right.set_ylabel("from rank")
    m_in, r_in, m_out, r_out = _links(sent, per_node)
    right.set_title(f"rows sent this step: inside nodes {m_in} messages ({r_in} rows),\n"
                    f"across nodes {m_out} messages ({r_out} rows, red)", fontsize=9)
    return fig
