"""CollectiveAnimator: run a real all-reduce on a Cluster and step through what happened."""

from __future__ import annotations

import ipywidgets as w

from minipar import collectives
from minipar.plots import to_png
from minipar.runtime import Cluster

from .collective_view import (
    CollectiveRecording,
    record_all_reduce,
    render_collective_frame,
    render_collective_strip,
)


class CollectiveAnimator(w.VBox):
    """Pick an algorithm and K; "run" meters the real collective; Play steps through it.

    Ranks are started once per K and reused; frames are drawn once and cached.
    """

    def __init__(self, algorithm: str = "ring", world_size: int = 4) -> None:
        self._clusters: dict[int, Cluster] = {}
        self._cache: dict[int, bytes] = {}
        self.algorithm = w.Dropdown(options=collectives.ALL_REDUCE_ALGORITHMS, value=algorithm,
                                    description="algorithm")
        self.ranks = w.IntSlider(min=2, max=8, value=world_size, description="ranks",
                                 continuous_update=False)
        self.run_button = w.Button(description="run", button_style="primary")
        self.play = w.Play(min=0, max=1, interval=900, description="play")
        self.step = w.IntSlider(min=0, max=1, description="step", continuous_update=False)
        w.jslink((self.play, "value"), (self.step, "value"))
        self.image = w.Image(format="png")
        self.status = w.HTML()
        self.run_button.on_click(lambda _: self.record())
        self.step.observe(lambda change: self.show(change["new"]), names="value")
        super().__init__([w.HBox([self.algorithm, self.ranks, self.run_button]),
                          w.HBox([self.play, self.step, self.status]), self.image])
        self.record()

    def _cluster(self, k: int) -> Cluster:
        if k not in self._clusters:
            self._clusters[k] = Cluster(k, backend="gloo", timeout=60)
        return self._clusters[k]

    def record(self) -> CollectiveRecording:
        """Run the chosen all-reduce for real and show its first frame."""
        k = self.ranks.value
        self.recording = record_all_reduce(self.algorithm.value, k, cluster=self._cluster(k))
        self._cache = {}
        self.step.max = self.play.max = self.recording.frames - 1
        self.step.value = 0
        self.show(0)
        return self.recording

    def show(self, frame: int) -> None:
        if frame not in self._cache:
            self._cache[frame] = to_png(render_collective_frame(self.recording, frame))
        self.image.value = self._cache[frame]
        total = self.recording.link_bytes(frame).sum()
        self.status.value = f"{self.recording.frames - 1} steps; {total:g} bytes sent so far"

    def strip(self) -> bytes:
        """PNG of every step at once (for static pages)."""
        return to_png(render_collective_strip(self.recording))

    def close(self) -> None:
        for cluster in self._clusters.values():
            cluster.close()
        self._clusters = {}
        super().close()
