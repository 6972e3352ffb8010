"""MemoryExplorer: what each ZeRO stage keeps per rank, from the formula for any model
size, and measured on CPU ranks at a small size."""

from __future__ import annotations

import ipywidgets as w

from minipar import cost
from minipar.plots import memory_total
from minipar.sharded.bench import formula_memory, measure_memory

from .figure_view import FigureView
from .labels import full_labels
from .render import STAGE_NAMES, render_memory

PRECISIONS = {"float32": False, "bf16 + fp32 master": True}


class MemoryExplorer(w.VBox):
    """Parameters, ranks, precision, recomputation, micro-batch and sequence length ->
    bytes per rank for data parallelism and ZeRO-1, 2, 3 (ZeRO's formula for the model's
    states, Korthikanti et al.'s for the activations of a GPT-style model that size);
    "measure" trains a small MLP on 4 CPU ranks with each stage and draws what rank 0
    really held beside the formula."""

    def __init__(self, params: float = 65e9, ranks: int = 64, mixed: bool = True,
                 recompute: str = "full", micro_batch: int = 1, seq_len: int = 2048,
                 device_gb: float = 80.0) -> None:
        self.params = w.FloatLogSlider(value=params, base=10, min=8, max=12, step=0.1,
                                       description="parameters", readout_format=".2e",
                                       continuous_update=False)
        self.ranks = w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                                value=ranks, description="ranks")
        self.precision = w.Dropdown(options=list(PRECISIONS),
                                    value="bf16 + fp32 master" if mixed else "float32",
                                    description="precision")
        self.recompute = w.Dropdown(options=list(cost.RECOMPUTE), value=recompute,
                                    description="recompute")
        self.micro_batch = w.Dropdown(options=[1, 2, 4, 8, 16, 32], value=micro_batch,
                                      description="micro-batch")
        self.seq_len = w.Dropdown(options=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                                  value=seq_len, description="sequence")
        self.device = w.FloatSlider(value=device_gb, min=8, max=192, step=8,
                                    description="device GB", continuous_update=False)
        self.button = w.Button(description="measure", button_style="primary")
        self.status = w.HTML()
        self.view = FigureView()
        self.measured: list[dict] | None = None
        for control in (self.params, self.ranks, self.precision, self.recompute,
                        self.micro_batch, self.seq_len, self.device):
            control.observe(lambda _: self.draw(), names="value")
        self.button.on_click(lambda _: self.measure())
        super().__init__([w.HBox([self.params, self.ranks, self.precision]),
                          w.HBox([self.recompute, self.micro_batch, self.seq_len]),
                          w.HBox([self.device, self.button]), self.status, self.view])
        full_labels(self)
        self.draw()

    def shape(self) -> tuple[int, int, int]:
        """(layers, hidden, heads) of a GPT-style model with the chosen parameter count."""
        return cost.transformer_shape(self.params.value)

    def activation_bytes(self) -> float:
        """One rank's activations for one micro-batch (16-bit values; twice that in
        float32). ZeRO does not divide them: each rank runs its own micro-batch."""
        layers, hidden, heads = self.shape()
        acts = cost.activation_bytes(layers, hidden, self.seq_len.value,
                                     self.micro_batch.value, heads, self.recompute.value)
        return acts * (1 if PRECISIONS[self.precision.value] else 2)

    def rows(self) -> list[dict]:
        """The formula's bytes per rank for each stage at the current settings."""
        rows = formula_memory(self.params.value, self.ranks.value,
                              PRECISIONS[self.precision.value])
        acts = self.activation_bytes()
        for row in rows:
            row["activations"] = acts
        return rows

    def draw(self) -> None:
        rows = self.rows()
        device = self.device.value * 1e9
        fits = [STAGE_NAMES[r["stage"]] for r in rows if memory_total(r) <= device]
        layers, hidden, heads = self.shape()
        self.status.value = (f"fits in {self.device.value:.0f} GB: {', '.join(fits) or 'none'}"
                             f" &middot; as a GPT-style model: {layers} layers, hidden {hidden},"
                             f" {heads} heads; activations {rows[0]['activations'] / 1e9:.1f} GB"
                             " per rank")
        title = (f"{self.params.value:.2e} parameters on {self.ranks.value} ranks, "
                 f"{self.precision.value}")
        mixed = PRECISIONS[self.precision.value]
        measured = [r for r in (self.measured or []) if r.get("mixed") == mixed] or None
        self.view.show(render_memory(rows, measured, device, title))

    def measure(self) -> list[dict]:
        """Run each stage on 4 CPU ranks now (a few seconds) and redraw."""
        mixed = PRECISIONS[self.precision.value]
        self.status.value = "measuring on 4 CPU ranks..."
        self.measured = [{**r, "mixed": mixed} for r in measure_memory(4, mixed)]
        self.draw()
        return self.measured
