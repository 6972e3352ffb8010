"""Tiny models and data sets that lessons, tests and benchmarks train, deterministic by seed.

Each is a single-process twin that the parallel versions (pipeline stages,
tensor-parallel layers, MoE experts) are cut from and tested against."""

from __future__ import annotations

import math

import torch
from torch import nn


def mlp(sizes: list[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Linear layers with tanh between them, initialized from `seed`."""
    if len(sizes) < 2:
        raise ValueError(f"sizes must list at least an input and an output size; got {sizes}")
    # nn.Linear draws its init from the global RNG: seeding it makes every rank's twin the same
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b, dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def mlp_parameters(sizes: list[int]) -> int:
    """How many parameters `mlp(sizes)` has (weights and biases), without building it."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))


def linear_stack(width: int, blocks: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """`blocks` blocks of Linear(width, width) then tanh, initialized from `seed`: the
    model pipelines split into stages (one block is the smallest piece a stage holds)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width, dtype=dtype), nn.Tanh())
                           for _ in range(blocks)])


class FFN(nn.Module):
    """A transformer's feed-forward block: hidden -> ffn -> GELU -> hidden. It is the
    tensor-parallel lesson's MLP twin and each expert of an MoE layer."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class SelfAttention(nn.Module):
    """The single-process twin: causal multi-head attention on [seq, batch, hidden]."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.qkv(x), self.heads))


def attend(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention given [s, b, 3 * heads * d] packed as (head, q|k|v, d): each head's
    q, k and v sit together, so a column split of the packed projection keeps whole heads."""
    s, b, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.view(s, b, heads, 3, d).permute(3, 1, 2, 0, 4)  # each [b, heads, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    # above the diagonal: keys later than the query; -inf there leaves them zero weight
    mask = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
    weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (weights @ v).permute(2, 0, 1, 3).reshape(s, b, heads * d)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then + mlp(ln(x)). The single-process twin."""

    def __init__(self, hidden: int, heads: int, ffn: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.attn = SelfAttention(hidden, heads, dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.mlp = FFN(hidden, ffn, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # pre-norm, as GPT-2: an untouched residual path trains stably (Xiong et al. 2020)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """The single-process twin: token + position embeddings, blocks, a final norm and an
    output head tied to the token embedding; input [sequence, batch] token ids."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2,
                 seq_len: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(vocab, hidden, dtype=dtype)
        self.positions = nn.Embedding(seq_len, hidden, dtype=dtype)
        # a seed per block: block i's weights do not depend on which blocks were built before it,
        # so a block built alone from its seed equals the twin's
        self.blocks = nn.ModuleList(TransformerBlock(hidden, heads, 4 * hidden, seed + 1 + i,
                                                     dtype) for i in range(layers))
        self.norm = nn.LayerNorm(hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # learned positions as GPT-2's; [:, None, :] broadcasts them over the batch
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[0]))[:, None, :]
        for block in self.blocks:
            x = block(x)
        # the output head is the token embedding transposed (weight tying, Press and Wolf 2017)
        return self.norm(x) @ self.tokens.weight.t()  # logits [sequence, batch, vocab]


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
    x = torch.randn(samples, features, generator=generator, dtype=dtype)
    # / sqrt(features): x @ w has variance about 1, so tanh is not saturated
    w = torch.randn(features, outputs, generator=generator, dtype=dtype) / features**0.5
    y = torch.tanh(x @ w) + noise * torch.randn(samples, outputs, generator=generator,
                                                dtype=dtype)
    return x, y
