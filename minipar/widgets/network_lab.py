"""NetworkLab: train on real ranks over an emulated network and compare the runs."""

from __future__ import annotations

import ipywidgets as w
from matplotlib.figure import Figure

from minipar.slow_networks.lab import METHODS, network_run

from .figure_view import FigureView
from .labels import full_labels

LINKS = {"none": None, "ranks 0-1": (0, 1), "ranks 2-3": (2, 3)}
KILLS = {"nobody": None, "rank 1": 1, "rank 2": 2, "rank 3": 3, "rank 4": 4}


def render_network_runs(runs: dict[str, dict]) -> Figure:
    """Loss and step time per step for each labelled run; a dotted line where a worker
    died."""
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    loss_ax, time_ax = fig.subplots(1, 2)
    for label, run in runs.items():
        steps = range(len(run["losses"]))
        (line,) = loss_ax.plot(steps, run["losses"], marker=".", label=label)
        time_ax.plot(steps[1:], [s * 1e3 for s in run["seconds"][1:]], marker=".",
                     color=line.get_color())  # step 0 also connects the ranks
        if run["died"] is not None:
            for ax in (loss_ax, time_ax):
                ax.axvline(run["died"][0], color=line.get_color(), linestyle=":")
    loss_ax.set(xlabel="step", ylabel="training loss", yscale="log")
    time_ax.set(xlabel="step (from 1: step 0 also connects the ranks)",
                ylabel="step time (ms)", ylim=(0, None))
    loss_ax.legend(fontsize=7)
    return fig


class NetworkLab(w.VBox):
    """Pick a method, a latency per message, one slower link and a worker to kill (not with
    the all-reduce, which cannot go on without it); "run" trains on real ranks (a few
    seconds) and adds the run to the plot, so runs can be compared; "clear" starts over."""

    def __init__(self, method: str = "SGP", latency_ms: float = 2.0, steps: int = 12) -> None:
        self.method = w.Dropdown(options=METHODS, value=method, description="method")
        self.latency = w.FloatSlider(min=0.0, max=20.0, step=1.0, value=latency_ms,
                                     description="latency ms", continuous_update=False)
        self.link = w.Dropdown(options=list(LINKS), value="none", description="20 ms link")
        self.kill = w.Dropdown(options=list(KILLS), value="nobody", description="kill")
        self.steps = w.IntSlider(min=4, max=30, value=steps, description="steps",
                                 continuous_update=False)
        self.button = w.Button(description="run", button_style="primary")
        self.clear = w.Button(description="clear")
        self.status = w.HTML()
        self.view = FigureView()  # empty until a run
        self.runs: dict[str, dict] = {}
        self.button.on_click(lambda _: self._run_clicked())
        self.clear.on_click(lambda _: self._clear())
        self.method.observe(lambda _: self._method_changed(), "value")
        self._method_changed()
        super().__init__([w.HBox([self.method, self.latency, self.steps]),
                          w.HBox([self.link, self.kill, self.button, self.clear]),
                          self.status, self.view])
        full_labels(self)

    def _method_changed(self) -> None:
        method = self.method.value
        self.kill.disabled = method == "all-reduce"
        if self.kill.disabled:
            self.kill.value = "nobody"
        self.status.value = {
            "SWARM": "SWARM on 5 ranks: rank 0 trains, ranks 1-2 and 3-4 serve the two "
                     "stages; a killed worker's micro-batches go through again",
            "all-reduce": "all-reduce on 4 ranks: every step needs every rank, so no kill "
                          "here (lesson 10, section 5: checkpoints)",
        }.get(method, f"{method} on 4 ranks: a killed rank's peers skip it and go on")

    def _clear(self) -> None:
        self.runs = {}
        self.view.show()
        self._method_changed()

    def _run_clicked(self) -> None:
        """The button's run: a failure is shown in the widget, not lost in a log."""
        try:
            self.run()
        except Exception as error:  # noqa: BLE001 - any failure is the learner's to see
            self.status.value = f"the run failed: {str(error).splitlines()[0]}"

    def run(self) -> dict:
        """Train now with the current choices, add the run to the plot and return it."""
        self.status.value = "running on real ranks..."
        kill = KILLS[self.kill.value]
        result = network_run(self.method.value, self.steps.value, self.latency.value / 1e3,
                             LINKS[self.link.value], 0.02, kill, kill_step=self.steps.value // 3)
        label = f"{self.method.value}, {self.latency.value:g} ms"
        label += f", slow {self.link.value}" if LINKS[self.link.value] else ""
        label += f", rank {kill} killed" if kill else ""
        self.runs[label] = result
        self.view.show(render_network_runs(self.runs))
        mean = sum(result["seconds"][1:]) / max(len(result["seconds"]) - 1, 1)
        died = (f"; rank {result['died'][1]} died at step {result['died'][0]} and the run went "
                "on" if result["died"] else "")
        self.status.value = (f"{label}: {mean * 1e3:.0f} ms per step after the first, loss "
                             f"{result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}{died}")
        return result
