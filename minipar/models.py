"""Tiny models and data sets that lessons, tests and benchmarks train: deterministic by seed."""

from __future__ import annotations

import torch
from torch import nn


def mlp(sizes: list[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Linear layers with tanh between them, initialized from `seed`."""
    if len(sizes) < 2:
        raise ValueError(f"sizes must list at least an input and an output size; got {sizes}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b, dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class FFN(nn.Module):
    """A transformer's feed-forward block: hidden -> ffn -> GELU -> hidden. It is the
    tensor-parallel lesson's MLP twin and each expert of an MoE layer."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class TiedAutoencoder(nn.Module):
    """Encoder and decoder share one weight (tied), and a frozen scale never trains:
    the two kinds of parameter gradient synchronization most often gets wrong."""

    def __init__(self, width: int = 8, hidden: int = 4, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Linear(width, hidden, dtype=dtype)
        self.decoder_bias = nn.Parameter(torch.zeros(width, dtype=dtype))
        self.scale = nn.Parameter(torch.full((width,), 0.5, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        return (h @ self.encoder.weight + self.decoder_bias) * self.scale


def regression_data(samples: int, features: int, outputs: int = 1, seed: int = 0,
                    noise: float = 0.1, dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) with y a fixed random nonlinear function of x plus noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator, dtype=dtype)
    w = torch.randn(features, outputs, generator=generator, dtype=dtype) / features**0.5
    y = torch.tanh(x @ w) + noise * torch.randn(samples, outputs, generator=generator,
                                                dtype=dtype)
    return x, y
