"""The trainer's model as a single-process twin: a small modern decoder (Llama-style).

Pre-norm blocks with RMSNorm, rotary position embeddings, grouped-query attention and a
SwiGLU feed-forward; the output head tied to the embedding or not. The parallel
versions (tensor, sequence, context and pipeline parallel) are cut from this module and
tested against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .runtime.device import device

BALANCES = ("none", "aux", "bias")  # moe/balance.py: what each does


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of the decoder. Defaults are a byte-level model small enough for a
    laptop's CPU."""

    vocab_size: int = 256
    """Tokens the embedding knows (256: one per byte)."""
    layers: int = 4
    """Decoder blocks."""
    hidden: int = 128
    """Width of the residual stream."""
    heads: int = 4
    """Query heads; each is hidden / heads wide."""
    kv_heads: int = 2
    """Key/value heads, shared by heads / kv_heads query heads each (grouped-query
    attention, Ainslie et al. 2023; kv_heads = heads is plain multi-head attention)."""
    ffn_hidden: int = 0
    """SwiGLU's inner width; 0 picks Llama's 8/3 x hidden, rounded up to a multiple of 32."""
    seq_len: int = 128
    """Longest sequence the model is trained on (positions the rotary tables cover)."""
    tied: bool = True
    """Whether the output head reuses the embedding's weight (Press and Wolf 2017)."""
    rope_base: float = 10000.0
    """Base of the rotary embedding's frequencies (Su et al. 2021)."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    experts: int = 0
    """0: every block's feed-forward is one SwiGLU; E > 0: a mixture of E experts (each a
    GELU MLP of width ffn), dropless top-k routing (`minipar.moe.moe_decoder.MoEDecoder`)."""
    top_k: int = 2
    """Experts each token visits when experts > 0."""
    balance: str = "none"
    """How training keeps the experts' load even: "none", "aux" (the auxiliary loss) or
    "bias" (DeepSeek-V3's loss-free bias); minipar.moe.balance."""
    balance_coef: float = 0.01
    """The auxiliary loss's weight (Switch Transformer's 0.01)."""
    bias_rate: float = 0.001
    """The loss-free bias's step per optimizer step (DeepSeek-V3's 0.001)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        """SwiGLU's inner width, with 0 resolved."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-(8 * self.hidden // 3) // 32) * 32  # ceil to a multiple of 32, as Llama

    def check(self) -> None:
        """One line naming the field and what would work, for a shape that cannot be."""
        for name in ("vocab_size", "layers", "hidden", "heads", "kv_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads must divide hidden ({self.hidden}); got heads={self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"hidden / heads must be even for rotary embeddings; got "
                             f"{self.hidden} / {self.heads} = {self.head_dim}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads ({self.heads}); got "
                             f"kv_heads={self.kv_heads}")
        if self.ffn_hidden < 0:
            raise ValueError(f"ffn_hidden must be >= 0 (0: 8/3 x hidden); got {self.ffn_hidden}")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ValueError(f"experts must be >= 0 and top_k between 1 and experts; got "
                             f"experts={self.experts}, top_k={self.top_k}")
        if self.balance not in BALANCES or (self.balance != "none" and not self.experts):
            raise ValueError(f"balance must be one of {', '.join(BALANCES)}, and other than "
                             f"'none' only with experts > 0; got balance={self.balance!r}, "
                             f"experts={self.experts}")
        if not (self.balance_coef >= 0 and self.bias_rate >= 0):
            raise ValueError(f"balance_coef and bias_rate must be >= 0; got "
                             f"{self.balance_coef}, {self.bias_rate}")

    def parameters(self) -> int:
        """Exact parameter count of `Decoder(self)`; a tied head shares the embedding's
        weight, so that weight counts once."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv  # q_proj and o_proj, k_proj and v_proj
        block = attention + self._feed_forward_parameters() + 2 * h  # two RMSNorm weights
        head = 0 if self.tied else self.vocab_size * h
        return self.vocab_size * h + self.layers * block + h + head  # + the final norm

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward and backward) at `seq_len` (default: the
        config's), the numerator of MFU:

            6 N + 12 L T h

        with N the parameters that multiply activations (the blocks' projections and the
        head's matmul; not the embedding lookup, nor the norms' elementwise scales), L
        layers, T tokens of context and h = heads x head_dim. The second term is attention
        itself: per layer and token, q . k against T keys and the weighted sum of T values
        are 2 T h multiply-adds, 4 T h FLOPs forward, x 3 with the backward (twice the
        forward). Causal attention is counted in full, as PaLM's MFU does (Chowdhery et al.
        2022, appendix B: 6N + 12 L H Q T; Chinchilla's appendix F counts the same terms).
        With grouped-query attention the score work is still per query head, so h, not
        kv_heads x head_dim."""
        t = self.seq_len if seq_len is None else seq_len
        h, kv = self.hidden, self.kv_heads * self.head_dim
        # a mixture of experts counts what a token multiplies: the router and its k experts
        active = (h * self.experts + self.top_k * 2 * h * self.ffn if self.experts
                  else 3 * h * self.ffn)
        per_layer = 2 * h * h + 2 * h * kv + active
        matmul_params = self.layers * per_layer + self.vocab_size * h  # the head, tied or not
        return 6 * matmul_params + 12 * self.layers * t * h

    def _feed_forward_parameters(self) -> int:
        h, f = self.hidden, self.ffn
        if not self.experts:
            return 3 * h * f  # SwiGLU: gate, up, down
        # the router (h x E) and E experts of up (h x f + f) and down (f x h + h)
        return h * self.experts + self.experts * (2 * h * f + f + h)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang and Sennrich 2019): LayerNorm without the
    mean subtraction and without a bias."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as Llama: the mean of squares in float32 when x is bf16/fp16 (a sum of squares
        # loses too many bits in 8 or 11), cast back before the weight multiplies it
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rope_tables(head_dim: int, positions: torch.Tensor, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [len(positions), head_dim], for any integer positions: a
    context-parallel rank passes the global positions of the tokens it holds."""
    # frequency i turns base^(-2i/d) radians per position (Su et al. 2021); float64 angles,
    # so a float32 and a float64 model see the same tables up to the final cast
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64,
                                      device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    # each frequency twice, [f0..f(d/2-1), f0..f(d/2-1)]: the rotate-half layout below
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., seq, head_dim] by its positions' angles (cos, sin [seq, head_dim]).

    Rotate-half convention, as Llama and GPT-NeoX: dimension i pairs with i + head_dim/2
    (not with i + 1, as the paper and GPT-J interleave them). Either way q . k then depends
    only on the distance between the two positions."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)  # (a, b) -> (-b, a): a quarter turn
    return x * cos + rotated * sin


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, written out, over [batch, heads, seq, d]: the
    teaching reference that scaled_dot_product_attention must equal. Causal: the queries
    are the last of the keys' positions (all of them, or the newest tokens after a key/value
    cache's past), and query t sees the keys up to its own position."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        # -inf above the diagonal (keys after the query): exp(-inf) = 0 after the softmax
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device),
                                    float("-inf"))
    return scores.softmax(dim=-1) @ v


def causal_mask(queries: int, keys: int, device: torch.device | None = None) -> torch.Tensor:
    """[queries, keys], True where a query may see a key: the queries are the last
    `queries` of `keys` positions (a cache's past comes first), each seeing itself and
    everything before it."""
    past = keys - queries
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(past)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v [batch, kv_heads, seq, d] repeated to q's heads: kv head j serves query heads
    j*g .. j*g + g-1 (g = heads/kv_heads), so cutting both into the same number of
    contiguous chunks (tensor parallelism, Ulysses) keeps each query head with its kv head."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, explicit: bool = False
           ) -> torch.Tensor:
    """Causal attention of q [batch, heads, seq, d] over k, v [batch, kv_heads, seq, d]
    (`repeat_kv`): fused `scaled_dot_product_attention`, or `attention_reference` with
    explicit=True (same numbers, every step visible)."""
    k, v = repeat_kv(q, k, v)
    if explicit:
        return attention_reference(q, k, v, causal=True)
    if q.shape[-2] != k.shape[-2]:  # a cache's past: is_causal would align the corners wrong
        return nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_mask(q.shape[-2], k.shape[-2], q.device))
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                            explicit: bool = False, attend: Callable = attend,
                            keep: Callable | None = None) -> torch.Tensor:
    """The projections q [batch, seq, heads * d], k and v [batch, seq, kv_heads * d] ->
    attended heads [batch, seq, heads * d]: split into heads, RoPE, then causal attention
    by `attend(q, k, v, explicit)`, given k and v per kv head (context parallelism passes
    ring attention or Ulysses, which moves the kv heads before repeating them).
    `keep(k, v)`, given this call's rotated keys and values per kv head, returns the ones
    to attend to: a key/value cache keeps them and returns its past with them
    (generation.py). Head counts come from the shapes, so a
    tensor-parallel rank passes its local heads through the same code."""
    b, s = q.shape[:2]
    # [b, s, n * d] -> [b, n, s, d]: head i is columns i*d..(i+1)*d of the projection
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if keep is not None:  # cached per kv head, before the repeat: GQA's smaller cache
        k, v = keep(k, v)
    return attend(q, k, v, explicit).transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings, [batch, seq, hidden] in and
    out. Fused `scaled_dot_product_attention` by default; `explicit=True` runs
    `attention_reference` instead (same numbers, every step visible). `core` is what
    turns the projections into attended heads (`grouped_query_attention`): an extension
    point, e.g. a trainer recomputing it in backward (selective recomputation)."""

    core = staticmethod(grouped_query_attention)

    def __init__(self, hidden: int, heads: int, kv_heads: int, explicit: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.explicit = explicit
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                explicit: bool | None = None) -> torch.Tensor:
        out = self.core(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin,
                        self.head_dim, self.explicit if explicit is None else explicit)
        return self.o_proj(out)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the gated feed-forward of Shazeer 2020
    ("GLU Variants Improve Transformer"), as Llama uses it."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)). `make_mlp` builds
    the feed-forward: an extension point (the mixture of experts, moe/moe_decoder.py)."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden, c.norm_eps, dtype)
        self.attn = Attention(c.hidden, c.heads, c.kv_heads, dtype=dtype)
        self.mlp_norm = RMSNorm(c.hidden, c.norm_eps, dtype)
        self.mlp = self.make_mlp(c, dtype)

    def make_mlp(self, config: DecoderConfig, dtype: torch.dtype) -> nn.Module:
        if config.experts:
            raise ValueError(f"model.experts={config.experts} is a mixture-of-experts decoder: "
                             "build it with minipar.moe.moe_decoder.moe_decoder (minipar train "
                             "does), or set experts = 0")
        return SwiGLU(config.hidden, config.ffn, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                explicit: bool | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, explicit)
        return x + self.mlp(self.mlp_norm(x))


def run_block(block: DecoderBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              explicit: bool | None) -> torch.Tensor:
    """How the Decoder runs each block: plainly (a trainer may run it recomputed)."""
    return block(x, cos, sin, explicit)


class Decoder(nn.Module):
    """Token embedding, `config.layers` blocks, a final RMSNorm and the output head: ids
    [batch, seq] -> logits [batch, seq, vocab]. Weights drawn from `seed` (see `init`).
    `run_block` is how each block runs: an extension point (full recomputation wraps it);
    `make_block` is the block's class (the mixture of experts' in moe/moe_decoder.py)."""

    run_block = staticmethod(run_block)
    make_block = DecoderBlock

    def __init__(self, config: DecoderConfig, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        config.check()
        self.config = config
        # built on the meta device (no memory, no draws from the global RNG), then given
        # real storage on the rank's device and filled by init(seed)
        with torch.device("meta"):
            self.embed = nn.Embedding(config.vocab_size, config.hidden, dtype=dtype)
            self.blocks = nn.ModuleList(self.make_block(config, dtype)
                                        for _ in range(config.layers))
            self.norm = RMSNorm(config.hidden, config.norm_eps, dtype)
            self.head = nn.Linear(config.hidden, config.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=device())
        if config.tied:
            self.head.weight = self.embed.weight  # one Parameter (Press and Wolf 2017)
        self.init(seed)

    @torch.no_grad()
    def init(self, seed: int) -> None:
        """N(0, 0.02) for embedding and linear weights, the residual outputs (o_proj, down)
        scaled by 1/sqrt(2 layers) as GPT-2 does (two residual additions per block, so the
        stream's variance stays put with depth), norms to 1. Drawn in float32 on the CPU
        from one generator in parameter order: the same numbers on any machine, and a
        float64 model holds exactly its float32 twin's values; copied to the device."""
        if self.embed.weight.is_meta:  # a dry run's layout (train/dry_run.py): no values
            return
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, param in self.named_parameters():  # a tied weight is listed once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith("bias"):  # the experts' MLPs have biases: they start at zero
                param.zero_()
                continue
            std = residual_std if name.endswith(("o_proj.weight", "down.weight")) else 0.02
            # the same draws on any device: made here, copied over
            draw = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(draw * std)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                explicit: bool | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab]. `positions` [seq] (default 0..seq-1) place the tokens
        for the rotary tables only; attention stays causal within this call's tokens."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids)
        cos, sin = rope_tables(self.config.head_dim, positions, self.config.rope_base, x.dtype)
        for block in self.blocks:
            x = self.run_block(block, x, cos, sin, explicit)
        return self.head(self.norm(x))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token of the batch."""
        return cross_entropy(self(ids), targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [batch, seq, vocab] against targets [batch, seq]: the
    one loss every model, stage and trainer layout computes."""
    # low-precision logits are widened first: the log-softmax over the vocabulary is a sum
    wide = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    return nn.functional.cross_entropy(wide.flatten(0, 1), targets.flatten())


def decoder(config: DecoderConfig, seed: int = 0, dtype: torch.dtype = torch.float32
            ) -> Decoder:
    """The trainer's twin, deterministic from `seed` on any machine (a shape that cannot be
    is one line from `config.check()`, before anything is built)."""
    return Decoder(config, seed, dtype)
