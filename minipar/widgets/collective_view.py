"""A collective as frames: what each rank holds after each step, and who sent what to whom.

`record_all_reduce` runs minipar's real all-reduce on real ranks with the meter's
snapshots on; the render functions are pure (a recording in, a Figure out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

CHUNK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
                "#8C8C8C"]


@dataclass
class CollectiveStep:
    """One step: its phase, its messages (src, dst, chunk, bytes), every rank's buffer after."""

    phase: str
    sends: list[tuple[int, int, int | None, int]]
    buffers: list[list[float]]


@dataclass
class CollectiveRecording:
    """A metered run of one collective, ready to draw."""

    title: str
    world_size: int
    bounds: list[int]  # chunk c is elements bounds[c]:bounds[c+1]
    initial: list[list[float]]
    steps: list[CollectiveStep]

    @property
    def frames(self) -> int:
        return len(self.steps) + 1

    def link_bytes(self, upto_step: int) -> np.ndarray:
        """bytes[src, dst] sent in steps 0..upto_step-1."""
        matrix = np.zeros((self.world_size, self.world_size))
        for step in self.steps[:upto_step]:
            for src, dst, _, nbytes in step.sends:
                matrix[src, dst] += nbytes
        return matrix

    def buffers_at(self, frame: int) -> list[list[float]]:
        return self.initial if frame == 0 else self.steps[frame - 1].buffers


def _rank_side(algorithm: str, numel: int) -> tuple:
    import torch

    import minipar
    from minipar import collectives

    # rank r starts at 2**r: a sum's binary digits name exactly the ranks added into it
    tensor = torch.full((numel,), float(2 ** minipar.rank()), device=minipar.device())
    initial = tensor.tolist()
    with collectives.meter(snapshots=True) as m:
        collectives.all_reduce(tensor, algorithm=algorithm)
    snaps = [(phase, step, snap.tolist()) for phase, step, snap in m.snapshots]
    sends = [(t.step, t.peer, t.chunk, t.bytes) for t in m.transfers if t.direction == "send"]
    return initial, snaps, sends


def check_choice(algorithm: str, world_size: int) -> None:
    """A ValueError naming what to change unless `algorithm` is one of minipar's
    all-reduces and `world_size` an int from 2 to 8 (what the pictures can show)."""
    from minipar import collectives

    if algorithm not in collectives.ALL_REDUCE_ALGORITHMS:
        allowed = ", ".join(collectives.ALL_REDUCE_ALGORITHMS)
        raise ValueError(f"algorithm must be one of {allowed}; got {algorithm!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 2 <= world_size <= 8:
        raise ValueError(f"world_size must be an int from 2 to 8; got {world_size!r}")


def record_all_reduce(algorithm: str, world_size: int, numel: int | None = None,
                      cluster=None) -> CollectiveRecording:
    """Run minipar's all-reduce on real ranks (rank r starts with r+1 everywhere), metered."""
    from minipar import collectives
    from minipar.runtime import launch

    check_choice(algorithm, world_size)
    numel = numel or (2 * world_size if world_size <= 4 else world_size)
    if cluster is None:
        results = launch(_rank_side, world_size, algorithm, numel, backend="gloo", timeout=60)
    else:
        if cluster.world_size != world_size:
            raise ValueError(f"cluster has {cluster.world_size} ranks, world_size={world_size}")
        results = cluster.run(_rank_side, algorithm, numel)
    initial = [r[0] for r in results]
    steps = []
    for index, (phase, _, _) in enumerate(results[0][1]):
        sends = [(src, peer, chunk, nbytes) for src, r in enumerate(results)
                 for step, peer, chunk, nbytes in r[2] if step == index]
        steps.append(CollectiveStep(phase, sends, [r[1][index][2] for r in results]))
    return CollectiveRecording(f"all_reduce, {algorithm}, {world_size} ranks", world_size,
                               collectives.split_bounds(numel, world_size), initial, steps)


def recording_data(recording: CollectiveRecording) -> dict:
    """The recording as plain data for the browser view (collective.js): buffers at the
    start and after each step, each step's messages [src, dst, chunk, bytes], and the
    value every element holds when the sum is finished (rank r holds 2^r, so 2^K - 1)."""
    k = recording.world_size
    return {"title": recording.title, "world_size": k, "bounds": recording.bounds,
            "initial": recording.initial, "total": 2**k - 1,
            "steps": [{"phase": s.phase, "sends": [list(m) for m in s.sends],
                       "buffers": s.buffers} for s in recording.steps]}


def _chunk_of(bounds: list[int], i: int) -> int:
    return next(c for c in range(len(bounds) - 1) if bounds[c] <= i < bounds[c + 1])


def _draw_buffers(ax, recording: CollectiveRecording, frame: int, compact: bool) -> None:
    k, buffers = recording.world_size, recording.buffers_at(frame)
    numel = len(buffers[0])
    step = recording.steps[frame - 1] if frame else None
    sent = {(src, chunk) for src, _, chunk, _ in (step.sends if step else [])}
    for r in range(k):
        for i, value in enumerate(buffers[r]):
            c = _chunk_of(recording.bounds, i) if numel else 0
            edge = "black" if (r, c) in sent else "white"
            ax.add_patch(Rectangle((i, r - 0.4), 1, 0.8, facecolor=CHUNK_COLORS[c % 8],
                                   alpha=0.35 + 0.65 * min(value / (k * (k + 1) / 2), 1.0),
                                   edgecolor=edge, linewidth=2 if edge == "black" else 1))
            if not compact or numel <= 8:
                ax.text(i + 0.5, r, f"{value:g}", ha="center", va="center",
                        fontsize=6 if compact else 8)
    if step:
        for src, dst, chunk, _ in step.sends:
            color = CHUNK_COLORS[(chunk or 0) % 8] if chunk is not None else "black"
            bend = 0.5 if abs(dst - src) > 1 else 0.3
            ax.add_patch(FancyArrowPatch((-0.3, src), (-0.3, dst), arrowstyle="-|>",
                                         mutation_scale=10, color=color, linewidth=1.5,
                                         connectionstyle=f"arc3,rad={bend}"))
    ax.set_xlim(-2.2, numel + 0.2)
    ax.set_ylim(k - 0.5, -0.6)
    ax.set_yticks(range(k), [f"rank {r}" for r in range(k)], fontsize=7 if compact else 9)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    label = "start" if frame == 0 else f"step {frame}: {step.phase}"
    ax.set_title(label, fontsize=8 if compact else 10)


def render_collective_frame(recording: CollectiveRecording, frame: int) -> Figure:
    """Buffers after `frame` steps (0 = the start), this step's messages as arrows
    (colored by chunk; sent chunks outlined), and bytes per link so far."""
    if not 0 <= frame < recording.frames:
        raise ValueError(f"frame must be in 0..{recording.frames - 1}; got {frame}")
    fig = Figure(figsize=(10, 0.5 * recording.world_size + 1.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 1.2])
    _draw_buffers(left, recording, frame, compact=False)
    matrix = recording.link_bytes(frame)
    right.imshow(matrix, cmap="Blues", vmin=0, vmax=max(recording.link_bytes(
        recording.frames - 1).max(), 1))
    for (src, dst), value in np.ndenumerate(matrix):
        if value:
            right.text(dst, src, f"{value:g}", ha="center", va="center", fontsize=6)
    right.set_xticks(range(recording.world_size))
    right.set_yticks(range(recording.world_size))
    right.set_xlabel("to rank")
    right.set_ylabel("from rank")
    right.set_title(f"bytes per link so far ({matrix.sum():g} in all)", fontsize=9)
    fig.suptitle(recording.title, fontsize=11)
    return fig


def render_collective_strip(recording: CollectiveRecording, columns: int = 4) -> Figure:
    """Every frame side by side: the static picture for where no kernel runs."""
    rows = -(-recording.frames // columns)
    fig = Figure(figsize=(3.2 * columns, (0.35 * recording.world_size + 0.7) * rows),
                 layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index < recording.frames:
            _draw_buffers(ax, recording, index, compact=True)
        else:
            ax.set_visible(False)
    fig.suptitle(recording.title, fontsize=11)
    return fig
