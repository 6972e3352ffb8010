"""The trainer's decoder (`minipar.decoder`) as `MeshModel`'s layers: the token embedding,
one layer per block and the head, each holding this rank's part of the twin's weights.

- **tp**: blocks are `ParallelDecoderBlock`s (query and kv heads split together, SwiGLU
  split by its width); the embedding and the head split the vocabulary (Megatron's
  vocab-parallel embedding and cross-entropy, `tensor_parallel/vocab_parallel.py`: no
  rank holds a whole row of logits, and `decoder_loss` is their loss); the final norm is
  replicated.
- **sequence parallelism**: the embedding's sum over tp is a reduce-scatter along the
  sequence, the blocks run on slices, and the head gathers the sequence back (backward
  keeps each rank's slice). The blocks' norms then see only their slice:
  `sum_block_norms_in_backward` sums their gradients over tp.
- **cp**: each rank holds the tokens of the balanced (zig-zag) layout of every sequence;
  attention runs ring attention or Ulysses (`cp_kind`, `context_parallel.attention_cores`)
  and RoPE rotates by the tokens' global positions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from ..context_parallel import positions as cp_positions
from ..context_parallel.attention_cores import CP_CORES
from ..decoder import Decoder, cross_entropy, rope_tables, run_block
from ..runtime import device, rank, world_size
from ..tensor_parallel import (
    SEQUENCE_DIM,
    gather_from_parallel_region,
    sum_sequence_parallel_grads_in_backward,
)
from ..tensor_parallel.parallel_block import ParallelDecoderBlock
from ..tensor_parallel.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from .mesh import MeshGroups
from .model import NamedLayers


class DecoderEmbedding(nn.Module):
    """ids [batch, tokens this rank holds] -> activations [batch, tokens, hidden] (under
    sequence parallelism: this tp rank's slice of those tokens). Over tp each rank holds
    1/tp of the vocabulary's rows (`VocabParallelEmbedding`)."""

    def __init__(self, twin: Decoder, tp_group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tied = twin.config.tied
        self.embed = VocabParallelEmbedding(twin.embed, tp_group, sequence_parallel) \
            if world_size(tp_group) > 1 else copy.deepcopy(twin.embed)

    @property
    def tied_weight(self) -> nn.Parameter | None:
        return self.embed.weight if self.tied else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class DecoderLayer(nn.Module):
    """One block, with the rotary tables of the positions this rank's tokens hold. Its
    parameters are named as the twin's block's. `run_block` is the twin's extension
    point (full recomputation wraps it)."""

    run_block = staticmethod(run_block)

    def __init__(self, block: nn.Module, positions: torch.Tensor, head_dim: int,
                 rope_base: float) -> None:
        super().__init__()
        self.block, self.positions = block, positions
        self.head_dim, self.rope_base = head_dim, rope_base
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # by dtype, device

    def twin_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The block's parameters under the twin's names after its `blocks.i.` (MeshModel
        adds that): without this wrapper's `block.`."""
        named = getattr(self.block, "twin_named_parameters", self.block.named_parameters)
        return named()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the positions are fixed: the tables are built once per dtype (they follow x's, as
        # the twin's do) and device
        key = (x.dtype, x.device)
        if key not in self._rope:
            self._rope[key] = rope_tables(self.head_dim, self.positions.to(x.device),
                                          self.rope_base, x.dtype)
        cos, sin = self._rope[key]
        return self.run_block(self.block, x, cos, sin, None)


class DecoderHead(nn.Module):
    """The final norm and the output projection: logits [batch, tokens, vocab]. Tied, it
    holds the embedding module itself (one Parameter when pp = 1; with pp > 1 the copies'
    gradients are summed by MeshModel)."""

    def __init__(self, twin: Decoder, embedding: DecoderEmbedding, tp_group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.norm, self.tied = copy.deepcopy(twin.norm), twin.config.tied
        self.split = world_size(tp_group) > 1  # the vocabulary's rows split over tp
        if self.tied:
            self.embed = embedding.embed
        else:
            self.head = VocabParallelHead(twin.head, tp_group) if self.split \
                else copy.deepcopy(twin.head)
        self.group, self.sequence_parallel = tp_group, sequence_parallel

    @property
    def tied_weight(self) -> nn.Parameter | None:
        return self.embed.weight if self.tied else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # the head needs every token; backward keeps this rank's slice (the gradient is
            # whole on every rank: vocab_parallel_logits' f summed it over tp)
            x = gather_from_parallel_region(x, self.group, SEQUENCE_DIM)
        x = self.norm(x)
        weight = self.embed.weight if self.tied else self.head.weight
        if self.split:  # this rank's slice of the vocabulary's logits
            return vocab_parallel_logits(x, weight, self.group)
        # F.linear, as the twin's nn.Linear head: the same arithmetic, tied or not
        return nn.functional.linear(x, weight)


def decoder_loss(groups: MeshGroups, vocab: int) -> Callable[..., torch.Tensor]:
    """The cross-entropy of these layers' logits: `decoder.cross_entropy` on one tp rank,
    the vocab-parallel one (three reductions of per-token values) over tp."""
    if world_size(groups.tp) == 1:
        return cross_entropy
    return partial(vocab_parallel_cross_entropy, vocab=vocab, group=groups.tp)


def held_positions(groups: MeshGroups, seq_len: int) -> torch.Tensor:
    """The global positions of the tokens this rank holds of each sequence: all of them,
    or its cp rank's chunks of the balanced layout."""
    cp = world_size(groups.cp)
    if cp == 1:
        return torch.arange(seq_len, device=device())
    return cp_positions(rank(groups.cp), cp, seq_len, balanced=True)


def tensor_parallel_block(twin_block: nn.Module, groups: MeshGroups,
                          sequence_parallel: bool = False) -> nn.Module:
    """The default cut of a block: split over tp (a copy when tp = 1)."""
    if world_size(groups.tp) == 1:
        return copy.deepcopy(twin_block)
    return ParallelDecoderBlock(twin_block, groups.tp, sequence_parallel)


def decoder_layers(twin: Decoder, groups: MeshGroups, sequence_parallel: bool = False,
                   cut_block: Callable[[nn.Module, MeshGroups], nn.Module] | None = None,
                   cp_kind: str = "ring") -> NamedLayers:
    """The decoder as (twin name prefix, layer): embedding, blocks, head, cut for this
    rank's tp and cp coordinates (groups needs dimensions pp, tp and cp). `cut_block`
    cuts each twin block for this rank (the extension point: the mixture of experts'
    blocks are cut over ep, moe/moe_decoder.py); by default `tensor_parallel_block`.
    `cp_kind` names how a cp group attends, a key of `CP_CORES`."""
    c = twin.config
    positions = held_positions(groups, c.seq_len)
    embedding = DecoderEmbedding(twin, groups.tp, sequence_parallel)
    blocks = []
    for i, twin_block in enumerate(twin.blocks):
        block = (cut_block(twin_block, groups) if cut_block is not None
                 else tensor_parallel_block(twin_block, groups, sequence_parallel))
        if world_size(groups.cp) > 1:
            block.attn.core = CP_CORES[cp_kind](groups.cp)  # the ring, or Ulysses' all-to-all
        blocks.append((f"blocks.{i}.", DecoderLayer(block, positions, c.head_dim, c.rope_base)))
    head = DecoderHead(twin, embedding, groups.tp, sequence_parallel)
    return [("", embedding), *blocks, ("", head)]


def sum_block_norms_in_backward(layers: nn.Module, tp_group) -> None:
    """Sequence parallelism: sum over tp, inside backward, the gradients of the blocks'
    norms, which each saw only this rank's slice (not the head's norm: it ran on the
    gathered sequence). Call once, when the layers are built."""
    for layer in layers.modules():
        if isinstance(layer, DecoderLayer):
            sum_sequence_parallel_grads_in_backward(layer.block, tp_group)
