"""ScheduleExplorer: build a pipeline schedule, watch it play, measure it on real ranks."""

from __future__ import annotations

import ipywidgets as w

from minipar.pipeline import (
    SCHEDULES,
    in_flight_over_time,
    peak_in_flight,
    schedule,
    simulate,
    simulate_bubble_work,
)

from .gantt import GanttView, gantt_panel, step_panel
from .labels import full_labels
from .render import compared_runs


class ScheduleExplorer(w.VBox):
    """Controls for schedule, stages, micro-batches, virtual stages and F/B/W costs; a
    Gantt of the simulated run with activations held over time, drawn by the browser
    (Play replays it there); "measure" runs the schedule on a Cluster (balanced synthetic
    stages) and draws the real Timeline under the ideal one, with the simulator's
    prediction from the run's own costs on the same time axis; "fill bubbles" packs
    PipeFisher-style extra work into idle time. An impossible choice greys the picture
    and says why."""

    def __init__(self, name: str = "1f1b", stages: int = 4, microbatches: int = 8) -> None:
        self.name = w.Dropdown(options=list(SCHEDULES), value=name, description="schedule")
        self.stages = w.IntSlider(min=1, max=8, value=stages, description="stages",
                                  continuous_update=False)
        self.microbatches = w.IntSlider(min=1, max=16, value=microbatches,
                                        description="micro-batches", continuous_update=False)
        self.virtual = w.IntSlider(min=1, max=4, value=1, description="virtual",
                                   continuous_update=False)
        self.backward = w.FloatSlider(min=0.5, max=4, value=2, step=0.5, description="B / F",
                                      continuous_update=False)
        self.weight_share = w.FloatSlider(min=0.1, max=0.9, value=0.5, step=0.1,
                                          description="W share of B", continuous_update=False)
        # DualPipeV's overlapped pairs: 1 is one CPU thread (F then B), less is a GPU's overlap
        self.overlap = w.FloatSlider(min=0.5, max=1.0, value=1.0, step=0.05,
                                     description="F&B / (F+B)", continuous_update=False)
        self.fill = w.Checkbox(value=False, description="fill bubbles (PipeFisher)")
        self.measure_button = w.Button(description="measure", button_style="primary")
        self.status = w.HTML()
        self.view = GanttView()
        self.measured = self.predicted = None
        for control in (self.name, self.stages, self.microbatches, self.virtual, self.backward,
                        self.weight_share, self.overlap, self.fill):
            control.observe(lambda _: self.update(), names="value")
        self.measure_button.on_click(lambda _: self.measure())
        super().__init__([w.HBox([self.name, self.stages, self.microbatches]),
                          w.HBox([self.virtual, self.backward, self.weight_share]),
                          w.HBox([self.overlap, self.fill, self.measure_button]),
                          self.status, self.view])
        full_labels(self)
        self.update()

    def costs(self) -> dict[str, float]:
        """Seconds per action kind: F takes 1 ms, the others relative to it; an overlapped
        F&B pair (DualPipeV's) a share of F + B."""
        b = self.backward.value
        return {"F": 1e-3, "B": b * 1e-3, "I": b * (1 - self.weight_share.value) * 1e-3,
                "W": b * self.weight_share.value * 1e-3,
                "F&B": (1 + b) * self.overlap.value * 1e-3}

    def update(self) -> None:
        """Rebuild the schedule from the controls and redraw; an impossible choice greys
        the picture and says why instead of leaving the last one up."""
        self.measured, self.predicted = None, None
        try:
            family = SCHEDULES[self.name.value]
            # a V holds its fixed two stages per rank, whatever the slider says
            virtual = family.stages_per_rank or (self.virtual.value if family.takes_virtual
                                                 else 1)
            self.plan = schedule(self.name.value, self.stages.value, self.microbatches.value,
                                 virtual)
        except ValueError as err:
            self.status.value = f"<b>not possible:</b> {err}"
            self.view.greyed = f"not possible: {err} (the picture is the last valid choice)"
            return
        self.ideal = simulate(self.plan, self.costs())
        before = self.ideal.summary(self.plan.ranks).bubble_fraction
        text = (f"bubble {before:.1%}; activations held at peak per rank: "
                f"{peak_in_flight(self.plan)}")
        if self.fill.value:
            # units of 0.75 F: they don't always fit, as real work units don't
            self.ideal = simulate_bubble_work(self.ideal, unit_cost=0.75e-3)
            filled = self.ideal.filter(track="compute")
            utilization = 1 - filled.summary(self.plan.ranks).bubble_fraction
            text += f"; with extra work in the bubbles: utilization {1 - before:.1%} -> " \
                    f"{utilization:.1%}"
        self.status.value = text
        self._draw()

    def panels(self) -> list[dict]:
        """What the browser draws: the ideal run, the prediction and the measured run (on
        one time axis) when measured, and the activations each rank holds over time."""
        ranks = self.plan.ranks
        bubble = self.ideal.summary(ranks).bubble_fraction
        panels = [gantt_panel(self.ideal, f"ideal (simulated): bubble {bubble:.1%}")]
        runs, shared = compared_runs(self.predicted, self.measured, ranks)
        panels += [gantt_panel(real, title, axis_ms=shared, plays=False) for title, real in runs]
        held = in_flight_over_time(self.ideal)
        panels.append(step_panel(held, "activations held (micro-batches) per rank",
                                 "held", self.ideal.makespan * 1e3))
        return panels

    def _draw(self) -> None:
        self.view.panels = self.panels()
        self.view.greyed = ""

    def measure(self):
        """Run the current schedule on real ranks and draw its Timeline under the ideal,
        beside the simulator's prediction from the run's own costs on the same time axis
        (message time from the fitted machine, if `minipar bench collectives` saved one)."""
        from minipar.machine import Machine
        from minipar.pipeline.bench import last_step, predicted_vs_measured, schedule_step_seconds
        from minipar.runtime import launch

        before = self.status.value
        self.status.value = "measuring on real ranks..."
        width, batch = 512, 2048
        run = launch(schedule_step_seconds, self.plan.ranks, self.plan.name, self.plan.microbatches,
                     self.plan.virtual, width, batch, 4, 1, backend="gloo", timeout=120)
        self.measured = last_step(run.timeline, self.plan)
        try:
            p2p = Machine.load("gloo").p2p_seconds(batch * width * 4 / self.plan.microbatches)
            fitted = ""
        except FileNotFoundError:
            p2p, fitted = 0.0, " (messages not priced: run `minipar bench collectives` to fit them)"
        compared = predicted_vs_measured(self.measured, self.plan, p2p)
        self.predicted = simulate(self.plan, compared["costs"])
        self._draw()
        self.status.value = (f"{before}; measured bubble {compared['bubble_measured']:.1%}, "
                             f"predicted {compared['bubble_predicted']:.1%}{fitted}")
        return self.measured
