"""CollectiveAnimator: run a real all-reduce on a Cluster and step through what happened,
drawn by the browser (collective.js): Play needs no kernel, so a static page still plays."""

from __future__ import annotations

import anywidget
import ipywidgets as w
import traitlets

from minipar import collectives
from minipar.plots import to_png
from minipar.runtime import Cluster

from .collective_view import (
    CollectiveRecording,
    check_choice,
    record_all_reduce,
    recording_data,
    render_collective_strip,
)
from .esm import esm
from .labels import full_labels


class CollectiveView(anywidget.AnyWidget):
    """A recording (from `recording_data`) drawn as SVG: each rank's buffer after each
    step, the step's messages as arrows and the bytes per link so far; `frame` is the step
    shown (0 = the start); `greyed` says why the picture is not of the current input."""

    _esm = esm("collective.js")
    recording = traitlets.Dict().tag(sync=True)
    frame = traitlets.Int(0).tag(sync=True)
    greyed = traitlets.Unicode("").tag(sync=True)
    frame_ms = traitlets.Int(900).tag(sync=True)  # how long Play shows each step


class CollectiveAnimator(w.VBox):
    """Pick an algorithm and K: the collective runs for real on K ranks, metered, and the
    browser steps through it. Ranks are started once per K and reused; `stop()` shuts
    them down and leaves the picture."""

    def __init__(self, algorithm: str = "ring", world_size: int = 4) -> None:
        self._clusters: dict[int, Cluster] = {}
        check_choice(algorithm, world_size)
        self.algorithm = w.Dropdown(options=collectives.ALL_REDUCE_ALGORITHMS, value=algorithm,
                                    description="algorithm")
        self.ranks = w.IntSlider(min=2, max=8, value=world_size, description="ranks",
                                 continuous_update=False)
        self.run_button = w.Button(description="run again", tooltip="measure it once more")
        self.status = w.HTML()
        self.view = CollectiveView()
        for control in (self.algorithm, self.ranks):
            control.observe(lambda _: self.record(), names="value")
        self.run_button.on_click(lambda _: self.record())
        super().__init__([w.HBox([self.algorithm, self.ranks, self.run_button]), self.status,
                          self.view])
        full_labels(self)
        self.record()

    def _cluster(self, k: int) -> Cluster:
        if k not in self._clusters:
            self._clusters[k] = Cluster(k, backend="gloo", timeout=60)
        return self._clusters[k]

    def record(self) -> CollectiveRecording | None:
        """Run the chosen all-reduce for real and show it from the start. While it runs
        (and if it fails) the old picture is greyed and says why."""
        algorithm, k = self.algorithm.value, self.ranks.value
        self.view.greyed = f"running {algorithm} on {k} ranks..."
        try:
            recording = record_all_reduce(algorithm, k, cluster=self._cluster(k))
        except Exception as err:  # a failed run must not leave a picture of other input
            self.view.greyed = f"the run of {algorithm} on {k} ranks failed: {err}"
            self.status.value = f"<b>failed:</b> {err}"
            return None
        self.recording = recording
        with self.view.hold_sync():  # one message: the new run, from its start, ungreyed
            self.view.recording = recording_data(recording)
            self.view.frame = 0
            self.view.greyed = ""
        sent = recording.link_bytes(recording.frames - 1).sum()
        self.status.value = (f"{algorithm}, {k} ranks: {recording.frames - 1} steps, "
                             f"{sent:g} bytes sent in all")
        return recording

    def show(self, frame: int) -> None:
        """Show the buffers after `frame` steps (0 = the start)."""
        if not 0 <= frame < self.recording.frames:
            raise ValueError(f"frame must be in 0..{self.recording.frames - 1}; got {frame}")
        self.view.frame = frame

    def strip(self) -> bytes:
        """PNG of every step at once (for paper)."""
        return to_png(render_collective_strip(self.recording))

    def stop(self) -> None:
        """Shut the ranks down; the picture stays (a new choice starts them again)."""
        for cluster in self._clusters.values():
            cluster.close()
        self._clusters = {}

    def close(self) -> None:
        self.stop()
        super().close()
