"""The vocabulary split over tensor-parallel ranks (Megatron-LM): the embedding, the output
head and the cross-entropy, with no rank ever holding a whole row of logits.

Without it every tp rank keeps the whole [vocab, hidden] embedding and head, computes
every logit, and holds [tokens, vocab] of them for the loss. With it, rank r holds rows
r*V/tp .. of both matrices:

- **embedding**: a token's row lives on one rank; the others look up nothing and add
  zeros, and one all-reduce (Megatron's g; under sequence parallelism a reduce-scatter)
  gives every rank the sum;
- **head**: a column-parallel linear over the vocabulary (its input passed through f, so
  its gradient is all-reduced): each rank's logits are its vocabulary slice;
- **cross-entropy**: log-softmax needs the max, the sum of exponentials and the target's
  logit over the whole vocabulary. Each is a reduction of a value per token: the local
  max all-reduced by max, the local sum of exp(logit - max) all-reduced by sum, and the
  target's logit from the one rank whose slice holds it (the others add 0). Three
  messages of [tokens] floats instead of [tokens, vocab].

A vocabulary that tp does not divide is padded to the next multiple. The padded rows are
never looked up, but their logits exist: each must be -inf before the softmax, or the
softmax spreads probability over tokens that do not exist, the loss is not the model's,
and gradients flow into the padding (Megatron-LM#1754). `vocab_parallel_cross_entropy`
masks every column at or past `vocab`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import collectives
from .mappings import (
    _tp,
    copy_to_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (each rank an equal slice)."""
    return math.ceil(vocab / tp) * tp


def vocab_slice(vocab: int, group=None) -> tuple[int, int]:
    """[start, end) of the padded vocabulary this tp rank holds."""
    me, size = _tp(group)
    per = padded_vocab(vocab, size) // size
    return me * per, (me + 1) * per


def shard_rows(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] matrix, zero rows where the padding falls."""
    start, end = vocab_slice(full.shape[0], group)
    rows = torch.zeros(end - start, *full.shape[1:], dtype=full.dtype, device=full.device)
    real = full[start:end]  # shorter than the slice on the rank that holds the padding
    rows[:len(real)] = real
    return rows


class VocabParallelEmbedding(nn.Module):
    """`twin` (an nn.Embedding) with its rows split over the tp group; the output is whole on
    every rank (or, sequence parallel, this rank's slice of the sequence)."""

    def __init__(self, twin: nn.Embedding, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab = twin.num_embeddings
        self.start, self.end = vocab_slice(self.vocab, group)
        with torch.no_grad():
            self.weight = nn.Parameter(shard_rows(twin.weight.detach(), group))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        # a token outside this slice looks up row 0 and is zeroed: the rank holding it adds it
        local = torch.where(outside, 0, ids - self.start)
        x = nn.functional.embedding(local, self.weight) * (~outside).unsqueeze(-1)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(x, self.group)
        return reduce_from_parallel_region(x, self.group)


class VocabParallelHead(nn.Module):
    """`twin` (an nn.Linear [vocab, hidden], no bias) with its rows split over the tp group:
    this rank's slice of the logits."""

    def __init__(self, twin: nn.Linear, group=None) -> None:
        super().__init__()
        self.group = group
        with torch.no_grad():
            self.weight = nn.Parameter(shard_rows(twin.weight.detach(), group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(x, self.weight, self.group)


def vocab_parallel_logits(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the logits: x (whole on every rank) times its rows of the head
    (f in front: every rank's slice depends on x, so x's gradient is summed over tp)."""
    return nn.functional.linear(copy_to_parallel_region(x, group), weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary over the group."""

    @staticmethod
    def forward(ctx, logits, targets, vocab, group):
        start = vocab_slice(vocab, group)[0]
        logits = logits.clone()  # masked and shifted in place below: autograd's copy is kept
        columns = torch.arange(start, start + logits.shape[-1], device=logits.device)
        logits[..., columns >= vocab] = -math.inf  # the padding: no token lives there
        # the max over the whole vocabulary, for a stable exp; no gradient flows through it
        largest = collectives.all_reduce(logits.max(-1).values, op="max", group=group)
        logits -= largest.unsqueeze(-1)
        exp = logits.exp()
        total = collectives.all_reduce(exp.sum(-1), group=group)
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        local = torch.where(mine, targets - start, 0)
        # the target's shifted logit from the rank that holds it; the others add 0
        # (where, not a product: a slice that is all padding gathers -inf, and -inf * 0 is nan)
        picked = torch.where(mine, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        target_logit = collectives.all_reduce(picked, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), mine, local)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local = ctx.saved_tensors
        # d loss / d logit = softmax - one-hot(target); the one-hot only where this rank holds it
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int,
                                 group=None) -> torch.Tensor:
    """Mean cross-entropy of this rank's vocabulary slice of the logits [..., V_padded/tp]
    against targets [...]: the same number on every rank, equal to `decoder.cross_entropy`
    over the gathered logits. Columns at or past `vocab` are padding and masked (passing
    the padded size instead reproduces Megatron-LM#1754's bug)."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match the logits' leading "
                         f"dimensions {tuple(logits.shape[:-1])}")
    # low-precision logits are widened first, as decoder.cross_entropy does
    wide = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    return _VocabParallelCrossEntropy.apply(wide, targets, vocab, group).mean()
