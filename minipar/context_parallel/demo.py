"""The context-parallel demo: causal attention over a sequence split across the ranks,
by ring attention (balanced layout) and by Ulysses' all-to-all, each rank checking its
output and its q, k, v gradients against one process. `python -m
minipar.context_parallel`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import time

import torch

from .. import collectives
from ..demo import Check, Context, Row, start_clock
from ..runtime import device, rank, world_size
from .attention import attention, positions
from .ring import RingWork, ring_attention
from .ulysses import ulysses_attention

BATCH, HEADS, HEAD_DIM = 1, 4, 16


def _case(method: str, seq_len: int) -> Check:
    k, me = world_size(), rank()
    balanced = method == "ring"
    # the same seed on every rank: each draws the whole sequence, then keeps its own tokens
    gen = torch.Generator().manual_seed(21)
    # the same seeded draws on any device, moved just below
    q, kk, v, w = [torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=gen,
                               dtype=torch.float64).to(device()) for _ in range(4)]
    # clones as fresh leaves: the reference's gradients must not land on q, kk, v themselves
    full = [t.clone().requires_grad_() for t in (q, kk, v)]
    # a random weight w, not a plain sum: every output entry gets its own upstream gradient,
    # a stronger test of the backward than all ones
    (attention(*full, causal=True) * w).sum().backward()
    want = [attention(q, kk, v, causal=True)] + [t.grad for t in full]
    pos = positions(me, k, seq_len, balanced)
    mine = [t[..., pos, :].clone().requires_grad_() for t in (q, kk, v)]
    work = RingWork()
    start = start_clock()
    with collectives.meter() as m:
        if method == "ring":
            out = ring_attention(*mine, causal=True, balanced=True, work=work)
        else:
            out = ulysses_attention(*mine, causal=True)
        (out * w[..., pos, :]).sum().backward()
    seconds = time.perf_counter() - start
    got = [out.detach()] + [t.grad for t in mine]
    ok = all(torch.allclose(g, x[..., pos, :], rtol=1e-10, atol=1e-12)
             for g, x in zip(got, want, strict=True))
    if method == "ring":
        title, note = (f"ring attention, causal, balanced (S={seq_len})",
                       f"output, dq, dk, dv; rank {me} computed {work.forward} score entries")
    else:
        title, note = f"Ulysses all-to-all attention, causal (S={seq_len})", "output, dq, dk, dv"
    return Check(title, ok, seconds, m.sent_bytes, note=note)


def demo(seq_len: int = 64) -> list[Check]:
    """On every rank: ring attention and (where the heads split evenly) Ulysses."""
    checks = [_case("ring", seq_len)]
    if HEADS % world_size() == 0:
        checks.append(_case("ulysses", seq_len))
    return checks


def check_options(ranks: int, seq_len: int = 64) -> None:
    """`python -m minipar.context_parallel`'s options, checked before any rank starts."""
    positions(0, ranks, seq_len, balanced=True)  # raises ValueError naming the fix


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo) + ctx.checks(4, demo)
