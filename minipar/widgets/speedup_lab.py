"""SpeedupLab: measure data-parallel speedup on real ranks beside the ideal and the model."""

from __future__ import annotations

import ipywidgets as w

from minipar.data_parallel.speedup import COMPRESSION_CHOICES, measure_speedup

from .figure_view import FigureView
from .labels import full_labels
from .render import render_speedup

BUCKETS = {"one per parameter": None, "256 KiB": 256 << 10, "1 MiB": 1 << 20, "25 MiB": 25 << 20}


class SpeedupLab(w.VBox):
    """Pick ranks, model width, batch per rank, bucket size and compression; "measure"
    runs the training steps on 1..K real ranks (a few seconds) and plots the result."""

    def __init__(self, ranks: int = 2, width: int = 256, per_rank: int = 512) -> None:
        self.ranks = w.IntSlider(min=2, max=4, value=ranks, description="max ranks",
                                 continuous_update=False)
        self.width = w.Dropdown(options=[128, 256, 512, 1024, 2048], value=width,
                                description="width")
        self.per_rank = w.Dropdown(options=[8, 32, 64, 128, 512], value=per_rank,
                                   description="batch/rank")
        self.bucket = w.Dropdown(options=list(BUCKETS), value="1 MiB", description="bucket")
        self.compression = w.Dropdown(options=COMPRESSION_CHOICES, value="none",
                                      description="compression")
        self.button = w.Button(description="measure", button_style="primary")
        self.view = FigureView()
        self.status = w.HTML("press measure: runs real ranks")
        self.button.on_click(lambda _: self.measure())
        self.rows: list[dict] = []
        super().__init__([w.HBox([self.ranks, self.width, self.per_rank]),
                          w.HBox([self.bucket, self.compression, self.button]),
                          self.status, self.view])
        full_labels(self)
        for control in (self.ranks, self.width, self.per_rank, self.bucket, self.compression):
            control.observe(lambda _: self._changed(), names="value")

    def _changed(self) -> None:
        if self.rows:  # the picture is of the last run's settings, not these
            self.view.greyed = ("the settings changed since this run (its title says which it "
                                "used): press measure to run these")

    def measure(self) -> list[dict]:
        """Run the measurement now and redraw; returns the rows it plotted."""
        self.status.value = "measuring..."
        self.rows = measure_speedup(self.ranks.value, self.width.value, self.per_rank.value,
                                    BUCKETS[self.bucket.value], self.compression.value)
        self.view.show(render_speedup(self.rows, self._title()))
        best = max(self.rows, key=lambda r: r["speedup"])
        self.status.value = (f"best: {best['speedup']:.2f}x on {best['ranks']} ranks "
                             f"(ideal {best['ranks']}x)")
        return self.rows

    def _title(self) -> str:
        return (f"width {self.width.value}, {self.per_rank.value}/rank, bucket "
                f"{self.bucket.value}, compression {self.compression.value}")
