"""The small regression task every data-parallel trainer's demo runs (lessons 02, 06 and
10): one model, one set of batches, one loss and learning rate, so each trainer is
compared with one process on exactly the same work."""

from __future__ import annotations

import torch

from ..models import mlp, regression_data

STEPS, BATCH, LR = 4, 64, 0.05


def batches(steps: int = STEPS, dtype: torch.dtype = torch.float64) -> list:
    """`steps` global batches of 64 samples with 32 features."""
    x, y = regression_data(steps * BATCH, 32, seed=7, dtype=dtype)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The MLP every trainer starts from (the same seed, so the same weights)."""
    return mlp([32, 256, 256, 1], seed=7, dtype=dtype)


def same(params: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal to one process's parameters up to float64 rounding of a different
    summation order (the all-reduce adds the ranks' partial sums)."""
    # on the host: a trainer that swaps its model through the device (ATOM) ends there
    return torch.allclose(params.cpu(), reference.cpu(), rtol=1e-9, atol=1e-12)
