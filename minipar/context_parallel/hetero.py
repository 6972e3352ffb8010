"""Heterogeneity-adaptive sequence parallelism: place a batch of variable-length sequences
on ranks of different speeds so that every rank finishes together.

A sequence of L tokens costs per_token * L (projections, MLP) + per_pair * L^2
(attention): one long sequence can outweigh many short ones. The naive split gives each
rank the same number of sequences; the balanced one (longest processing time first)
takes sequences from the most expensive down and gives each to the rank that would
finish it earliest at its speed. A synchronous step ends when the slowest rank does, so
the balanced split's step is usually shorter; the gradient is the same sum either way.
This places whole sequences (length- and speed-aware data parallelism); systems such as
FlexSP also vary how many ranks split each long sequence.

Speeds are emulated on CPU ranks: a rank of speed 1/2 computes each of its sequences
twice (real work, not a sleep).
"""

from __future__ import annotations

import time

import torch

from .. import collectives
from ..decoder import DecoderConfig, decoder, rope_tables
from ..runtime import device, rank, world_size


def sequence_cost(length: int, per_token: float = 1.0, per_pair: float = 0.01) -> float:
    """Modelled time of one sequence at speed 1."""
    return per_token * length + per_pair * length * length


def assign_even(lengths: list[int], ranks: int) -> list[list[int]]:
    """The naive split: consecutive sequences, the same count on every rank (indices)."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1; got {ranks}")
    per, extra = divmod(len(lengths), ranks)
    out, start = [], 0
    for r in range(ranks):
        n = per + (r < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def assign_balanced(lengths: list[int], speeds: list[float], per_token: float = 1.0,
                    per_pair: float = 0.01) -> list[list[int]]:
    """Longest processing time first: each sequence, most expensive first, goes to the rank
    that would finish it earliest, (load + cost) / speed. A heuristic: usually, not
    always, the shortest step."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"speeds must be positive, one per rank; got {speeds}")
    loads = [0.0] * len(speeds)
    out: list[list[int]] = [[] for _ in speeds]
    # Graham's LPT rule (1969): placing the big jobs first leaves the small ones to even out
    # the finish times; it is within 4/3 of the optimum on identical machines
    order = sorted(range(len(lengths)), key=lambda i: -sequence_cost(lengths[i], per_token,
                                                                     per_pair))
    for i in order:
        cost = sequence_cost(lengths[i], per_token, per_pair)
        r = min(range(len(speeds)), key=lambda j: (loads[j] + cost) / speeds[j])
        loads[r] += cost
        out[r].append(i)
    return [sorted(seqs) for seqs in out]


def predicted_step(assignment: list[list[int]], lengths: list[int], speeds: list[float],
                   per_token: float = 1.0, per_pair: float = 0.01) -> float:
    """The modelled step: the slowest rank's load over its speed."""
    return max(sum(sequence_cost(lengths[i], per_token, per_pair) for i in seqs) / s
               for seqs, s in zip(assignment, speeds, strict=True))


def variable_lengths(count: int, seed: int = 0, shortest: int = 16, longest: int = 512
                     ) -> list[int]:
    """A batch of sequence lengths with a long tail (log-uniform), as real corpora have."""
    gen = torch.Generator().manual_seed(seed)
    # uniform in log(length), then exp: many short sequences, a few long ones
    # lengths, read at once as Python ints
    logs = torch.empty(count).uniform_(float(torch.tensor(shortest).log()),
                                       float(torch.tensor(longest).log()), generator=gen)
    return [int(v) for v in logs.exp().round()]


def run_assignment(assignment: list[list[int]], lengths: list[int], speeds: list[float],
                   hidden: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32
                   ) -> tuple[float, torch.Tensor]:
    """On every rank: forward + backward of a decoder block over this rank's sequences
    (repeated 1/speed times to emulate a slower device), then the gradient all-reduce that
    ends a synchronous step. Returns (seconds until this rank's gradients are summed, the
    summed gradient, flattened)."""
    me, k = rank(), world_size()
    if len(assignment) != k or len(speeds) != k:
        raise ValueError(f"assignment and speeds need one entry per rank ({k}); got "
                         f"{len(assignment)} and {len(speeds)}")
    config = DecoderConfig(layers=1, hidden=hidden, heads=4, kv_heads=2,
                           seq_len=max(lengths, default=1))
    block = decoder(config, seed, dtype).blocks[0]
    gen = torch.Generator().manual_seed(seed + 1)
    # a CPU generator draws on the host: moved just below
    data = [torch.randn(1, n, hidden, generator=gen, dtype=dtype) for n in lengths]
    data = [x.to(device()) for x in data]
    # each sequence's rotary tables, by length (positions 0..n-1)
    rope = {n: rope_tables(config.head_dim, torch.arange(n, device=device()), config.rope_base,
                           dtype) for n in set(lengths)}
    repeats = round(1 / speeds[me])
    if repeats < 1 or abs(repeats * speeds[me] - 1) > 1e-9:
        raise ValueError(f"speeds must be 1/n for a whole n (a rank of speed 1/n computes "
                         f"each sequence n times); got {speeds[me]}")
    if k > 1:
        # every rank starts its clock together: the step is measured from a common start
        torch.distributed.barrier()
    start = time.perf_counter()
    for i in assignment[me]:
        for repeat in range(repeats):
            loss = block(data[i], *rope[lengths[i]]).pow(2).mean()
            if repeat == repeats - 1:  # the extra passes are the emulated slowness only
                loss.backward()
            else:
                # autograd.grad returns gradients without adding to .grad: real work, no effect
                torch.autograd.grad(loss, list(block.parameters()))
    # a rank with no sequences has no .grad yet: zeros keep every rank's vector the same shape
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in block.parameters()])
    if k > 1:
        collectives.all_reduce(flat)
    return time.perf_counter() - start, flat
