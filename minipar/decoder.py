"""The trainer's model as a single-process twin: a small modern decoder (Llama-style).

Pre-norm blocks with RMSNorm, rotary position embeddings, grouped-query attention and a
SwiGLU feed-forward; the output head tied to the embedding or not. The parallel
versions (tensor, sequence, context and pipeline parallel) are cut from this module and
tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass


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
