"""How big a global batch, and what learning rate: the batch thread of the course.

A data-parallel step's **global batch** is the rows every rank's gradients are averaged
over: micro-batch x accumulation steps x data-parallel ranks (x pipeline micro-batches,
which split a rank's batch further). Parallel layouts change how the global batch is
made, never the mathematics, once gradients are averaged by the right count.

The global batch is still a choice, and it has a limit. McCandlish et al., "An Empirical
Model of Large-Batch Training" (2018), Eq. 2.11: reaching a given loss takes
S = S_min (1 + B_noise / B) optimizer steps and E = E_min (1 + B / B_noise) samples. Well
below the *critical batch size* (about B_noise, the gradient noise scale) doubling the
batch halves the steps for almost no extra samples: data parallelism is free speed.
Well above it, doubling the batch doubles the samples (compute) and barely cuts the
steps. At B = B_noise both are twice their minimum.

A bigger batch averages away gradient noise, so it tolerates a larger learning rate:
Goyal et al. (2017) scale SGD's rate linearly with the batch (with a warm-up; it held to
8k images on ImageNet); for Adam, Malladi et al. (2022) derive the square-root rule."""

from __future__ import annotations

import math


def global_batch(micro_batch: int, accumulation: int = 1, dp: int = 1,
                 pipeline_microbatches: int = 1) -> int:
    """Rows one optimizer step averages over: micro-batch x accumulation x pipeline
    micro-batches x data-parallel ranks (the trainer splits its batch_size the same way)."""
    parts = {"micro_batch": micro_batch, "accumulation": accumulation, "dp": dp,
             "pipeline_microbatches": pipeline_microbatches}
    for name, value in parts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"global_batch: {name} must be an int >= 1; got {value!r}")
    return micro_batch * accumulation * pipeline_microbatches * dp


def steps_and_samples(batch: float, noise_scale: float) -> tuple[float, float]:
    """McCandlish et al.'s trade-off: (S / S_min, E / E_min) at global batch `batch` for a
    gradient noise scale `noise_scale` (same unit: samples or tokens)."""
    if batch <= 0 or noise_scale <= 0:
        raise ValueError(f"steps_and_samples needs batch > 0 and noise_scale > 0; got "
                         f"{batch} and {noise_scale}")
    return 1 + noise_scale / batch, 1 + batch / noise_scale


def scaled_learning_rate(lr: float, base_batch: float, batch: float,
                         rule: str = "linear") -> float:
    """The learning rate for `batch`, given `lr` tuned at `base_batch`: "linear" (Goyal
    et al. 2017, SGD) multiplies by batch / base_batch, "sqrt" (Malladi et al. 2022,
    Adam) by its square root. Both are starting points to tune from, with a warm-up."""
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"rule must be 'linear' (SGD) or 'sqrt' (Adam); got {rule!r}")
    if base_batch <= 0 or batch <= 0:
        raise ValueError(f"batches must be > 0; got base_batch={base_batch}, batch={batch}")
    ratio = batch / base_batch
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))
