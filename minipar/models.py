"""Tiny models and data sets that lessons, tests and benchmarks train, deterministic by seed.

Each is a single-process twin that the parallel versions (pipeline stages, data-parallel
replicas, MoE experts) are cut from and tested against. The transformer that lessons
04 onwards cut up is one model, the decoder (`minipar.decoder`)."""

from __future__ import annotations

import torch
from torch import nn

from .runtime.device import device


def mlp(sizes: list[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Linear layers with tanh between them, initialized from `seed`."""
    if len(sizes) < 2:
        raise ValueError(f"sizes must list at least an input and an output size; got {sizes}")
    # nn.Linear draws its init from the global RNG: seeding it makes every rank's twin the same;
    # drawn on the host and moved, so a GPU rank holds the CPU's numbers
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b, dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(device())


def mlp_parameters(sizes: list[int]) -> int:
    """How many parameters `mlp(sizes)` has (weights and biases), without building it."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))


def linear_stack(width: int, blocks: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """`blocks` blocks of Linear(width, width) then tanh, initialized from `seed`: the
    model pipelines split into stages (one block is the smallest piece a stage holds)."""
    torch.manual_seed(seed)
    # seeded on the host, then moved (as mlp)
    stack = nn.Sequential(*[nn.Sequential(nn.Linear(width, width, dtype=dtype), nn.Tanh())
                            for _ in range(blocks)])
    return stack.to(device())


class FFN(nn.Module):
    """A transformer's feed-forward block: hidden -> ffn -> GELU -> hidden, as GPT-2's:
    each expert of an MoE layer."""

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
        # h @ W (not W^T): the decoder is the encoder's map transposed, one shared Parameter
        return (h @ self.encoder.weight + self.decoder_bias) * self.scale


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, the loss of every regression twin (written out, not
    `F.mse_loss`, so a learner reads the whole arithmetic)."""
    return ((out - target) ** 2).mean()


def regression_data(samples: int, features: int, outputs: int = 1, seed: int = 0,
                    noise: float = 0.1, dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) with y a fixed random nonlinear function of x plus noise."""
    # a generator of its own: the data does not depend on, nor disturb, the global RNG
    generator = torch.Generator().manual_seed(seed)
    # drawn on the host: the same data on any device
    x = torch.randn(samples, features, generator=generator, dtype=dtype)
    # / sqrt(features): x @ w has variance about 1, so tanh is not saturated
    w = torch.randn(features, outputs, generator=generator, dtype=dtype) / features**0.5
    y = torch.tanh(x @ w) + noise * torch.randn(samples, outputs, generator=generator,
                                                dtype=dtype)
    return x.to(device()), y.to(device())
