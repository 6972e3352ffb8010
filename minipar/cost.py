"""Back-of-the-envelope calculators: how much compute, time and memory training takes.

Every number a lesson quotes comes out of these functions from stated inputs, so a
learner can change an input and watch the conclusion move.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_YEAR = 365.25 * 24 * 3600
GB = 1e9  # decimal gigabytes, as accelerator data sheets count them

DTYPE_BYTES = {"fp32": 4.0, "tf32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0,
               "int4": 0.5}
# Extra values an optimizer keeps per parameter (momentum, Adam's first and second moment).
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
RECOMPUTE = ("none", "selective", "full")


def _choice(name: str, value: str, allowed: dict | tuple) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0; got {value!r}")
    return value


def training_flops(params: float, tokens: float, flops_per_param_token: float = 6.0) -> float:
    """FLOPs to train a dense model: about 6 per parameter per token.

    2 for the forward multiply-add, 4 for the backward (gradients with respect to
    activations and to weights).
    """
    return flops_per_param_token * _positive("params", params) * _positive("tokens", tokens)


def training_time(flops: float, devices: int = 1, flops_per_device: float = 2.25e15,
                  utilization: float = 1.0) -> float:
    """Seconds to do `flops` on `devices` accelerators that each sustain a share of their peak.

    `utilization` is the share of peak actually achieved (published large runs
    reach 0.3-0.5); perfect scaling over devices is assumed, which is the
    optimistic bound the rest of the course takes apart.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1]; got {utilization!r}")
    _positive("devices", devices)
    return _positive("flops", flops) / (devices * _positive("flops_per_device",
                                                            flops_per_device) * utilization)


def activation_bytes(layers: int, hidden: int, seq_len: int, batch: int, heads: int,
                     recompute: str = "selective") -> float:
    """Activation memory of a transformer in 16-bit, after Korthikanti et al. (2022).

    Per layer and per sequence: s*h*(34 + 5*a*s/h) bytes with nothing recomputed,
    34*s*h when the attention scores are recomputed ("selective"), and 2*s*h when
    only each layer's input is kept and the rest recomputed ("full").
    """
    _choice("recompute", recompute, RECOMPUTE)
    s, h = seq_len, hidden
    per_token = {"none": 34 + 5 * heads * s / h, "selective": 34, "full": 2}[recompute]
    return layers * batch * s * h * per_token


@dataclass(frozen=True)
class MemoryBreakdown:
    """Training memory by component, in bytes."""

    params: float
    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.params

    def __str__(self) -> str:
        rows = [(name, getattr(self, name)) for name in
                ("weights", "gradients", "optimizer", "activations")] + [("total", self.total)]
        return "\n".join(f"{name:>12}: {value / GB:8.1f} GB" for name, value in rows)


def training_memory(params: float, weights: str = "bf16", grads: str = "bf16",
                    optimizer: str = "adam", optimizer_dtype: str = "fp32",
                    master_weights: str | None = None,
                    activations: float = 0.0) -> MemoryBreakdown:
    """Bytes needed to train a model of `params` parameters, by component.

    Weights and gradients take their dtype's size per parameter; the optimizer
    keeps OPTIMIZER_STATES[optimizer] values of `optimizer_dtype` per parameter,
    plus an optional full-precision `master_weights` copy (mixed precision);
    `activations` is in bytes (see `activation_bytes`).
    """
    _positive("params", params)
    for name, dtype in (("weights", weights), ("grads", grads),
                        ("optimizer_dtype", optimizer_dtype)):
        _choice(name, dtype, DTYPE_BYTES)
    _choice("optimizer", optimizer, OPTIMIZER_STATES)
    optimizer_bytes = OPTIMIZER_STATES[optimizer] * DTYPE_BYTES[optimizer_dtype]
    if master_weights is not None:
        optimizer_bytes += DTYPE_BYTES[_choice("master_weights", master_weights, DTYPE_BYTES)]
    if activations < 0:
        raise ValueError(f"activations must be >= 0 bytes; got {activations!r}")
    return MemoryBreakdown(params, params * DTYPE_BYTES[weights], params * DTYPE_BYTES[grads],
                           params * optimizer_bytes, activations)


def largest_model(memory_bytes: float, bytes_per_param: float) -> float:
    """Parameters that fit in `memory_bytes` at a given training cost per parameter."""
    return _positive("memory_bytes", memory_bytes) / _positive("bytes_per_param", bytes_per_param)
