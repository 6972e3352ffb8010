"""Which rank holds which block of X, A and Y under a tensor-parallel split: pure frames
and a renderer, plus the SplitViewer widget that steps through forward and backward."""

from __future__ import annotations

import textwrap

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
KINDS = ("column", "row", "megatron_mlp", "attention_heads")

# Each frame: (title, [(matrix name, split "rows"/"cols"/None, partial sum?)], operator note)
_FRAMES = {
    "column": [
        ("forward: f copies X to every rank", [("X", None, False), ("A", "cols", False)],
         "f = identity"),
        ("forward: each rank computes its columns of Y, no communication",
         [("X", None, False), ("A", "cols", False), ("Y", "cols", False)], ""),
        ("backward: each rank's dX is partial, f all-reduces it",
         [("dY", "cols", False), ("A", "cols", False), ("dX", None, True)], "f = all-reduce"),
    ],
    "row": [
        ("forward: X split by columns to match A's rows",
         [("X", "cols", False), ("A", "rows", False)], ""),
        ("forward: each rank holds a partial sum of all of Y",
         [("X", "cols", False), ("A", "rows", False), ("Y", None, True)], ""),
        ("forward: g all-reduces Y BEFORE the nonlinearity",
         [("Y", None, False)], "g = all-reduce"),
        ("backward: g passes dY to every rank unchanged; dX comes out split",
         [("dY", None, False), ("A", "rows", False), ("dX", "cols", False)], "g = identity"),
    ],
    "megatron_mlp": [
        ("forward: f copies X; column split of A gives each rank a slice of H",
         [("X", None, False), ("A", "cols", False), ("H", "cols", False)], "f = identity"),
        ("forward: GELU on the local slice (no communication), row split of B",
         [("H", "cols", False), ("B", "rows", False), ("Y", None, True)], ""),
        ("forward: g all-reduces the partial Y: one all-reduce forward",
         [("Y", None, False)], "g = all-reduce"),
        ("backward: g is identity, the slices flow back through B, GELU and A",
         [("dY", None, False), ("B", "rows", False), ("dH", "cols", False)], "g = identity"),
        ("backward: f all-reduces dX: one all-reduce backward",
         [("dH", "cols", False), ("A", "cols", False), ("dX", None, True)], "f = all-reduce"),
    ],
    "attention_heads": [
        ("forward: f copies X; Q, K, V split by heads (columns)",
         [("X", None, False), ("QKV", "cols", False)], "f = identity"),
        ("forward: each rank attends with its own heads, no communication",
         [("heads", "cols", False)], ""),
        ("forward: output projection split by rows: partial sums, g all-reduces",
         [("heads", "cols", False), ("O", "rows", False), ("Y", None, True)], "g = all-reduce"),
        ("backward: f all-reduces dX", [("dX", None, True)], "f = all-reduce"),
    ],
}


def split_frames(kind: str) -> list[tuple[str, list[tuple[str, str | None, bool]], str]]:
    """The steps of one split, forward then backward."""
    if kind not in _FRAMES:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    return _FRAMES[kind]


def render_split(kind: str, tp: int, frame: int) -> Figure:
    """One step: each matrix as blocks coloured by the rank that holds them (a stack of
    full copies, one per rank, when every rank holds the whole matrix; hatched = partial
    sums)."""
    if not 1 <= tp <= 4:
        raise ValueError(f"tp must be 1 to 4; got {tp}")
    frames = split_frames(kind)
    if not 0 <= frame < len(frames):
        raise ValueError(f"frame must be in 0..{len(frames) - 1}; got {frame}")
    title, matrices, operator = frames[frame]
    # every step of a split is drawn at one size, matrices centred, so Play never resizes
    slots = max(len(m) for _, m, _ in frames)
    width = max(2.4 * slots + 1, 5.0)
    fig = Figure(figsize=(width, 3.0), layout="constrained")
    all_axes = fig.subplots(1, slots, squeeze=False)[0]
    first = (slots - len(matrices)) // 2
    for ax in [*all_axes[:first], *all_axes[first + len(matrices):]]:
        ax.axis("off")
    axes = all_axes[first:first + len(matrices)]
    for ax, (name, split, partial) in zip(axes, matrices, strict=True):
        if split is None:  # every rank holds all of it: one full copy per rank, stacked
            step = 0.18 / max(tp - 1, 1)
            for r in reversed(range(tp)):
                ax.add_patch(Rectangle((r * step, 0.18 - r * step), 0.82, 0.82,
                                       facecolor=RANK_COLORS[r], linewidth=1.2,
                                       hatch="//" if partial else None, edgecolor="white"))
            ax.axis("off")
        for r in range(tp if split else 0):
            box = (r / tp, 0, 1 / tp, 1) if split == "cols" else (0, 1 - (r + 1) / tp, 1, 1 / tp)
            ax.add_patch(Rectangle(box[:2], box[2], box[3], facecolor=RANK_COLORS[r],
                                   alpha=0.8, hatch="//" if partial else None,
                                   edgecolor="white"))
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xticks([])
        ax.set_yticks([])
        held = {"cols": "split by columns", "rows": "split by rows",
                None: f"partial sum, {tp} copies" if partial else f"whole, {tp} copies"}[split]
        ax.set_title(f"{name}\n{held}", fontsize=8)
    heading = f"{kind}, {tp} ranks: {title}" + (f"   [{operator}]" if operator else "")
    fig.suptitle("\n".join(textwrap.wrap(heading, width=int(width * 13))), fontsize=9)
    return fig


def split_viewer(kind: str = "megatron_mlp", tp: int = 2):
    """Dropdown for the split and a slider for TP; every step of the choice is drawn and
    sent to the browser (SVG), where Play walks forward and backward without the kernel."""
    import ipywidgets as w

    from .figure_view import FigureView
    from .labels import full_labels

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    kind_box = w.Dropdown(options=KINDS, value=kind, description="split")
    tp_box = w.IntSlider(min=1, max=4, value=tp, description="TP size", continuous_update=False)
    view = FigureView(frame_ms=1500)

    def draw(_=None) -> None:
        frames = split_frames(kind_box.value)
        view.show(*(render_split(kind_box.value, tp_box.value, i) for i in range(len(frames))),
                  captions=[f"step {i + 1} of {len(frames)}: {title}"
                            for i, (title, _, _) in enumerate(frames)])

    for control in (kind_box, tp_box):
        control.observe(draw, names="value")
    draw()
    return full_labels(w.VBox([w.HBox([kind_box, tp_box]), view]))
