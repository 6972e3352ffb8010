"""The tensor-parallel demo: the decoder's SwiGLU and block (with and without sequence
parallelism) split over the ranks, each rank checking its output against the
one-process twin. `python -m minipar.tensor_parallel`, `minipar tour` and the tests run
`demo`."""

from __future__ import annotations

import time

import torch

from .. import collectives
from ..decoder import DecoderBlock, DecoderConfig, SwiGLU, rope_tables
from ..demo import Check, Context, Row, start_clock
from ..runtime import device, rank, world_size
from .parallel_block import ParallelDecoderBlock, ParallelSwiGLU

CASES = (("mlp", False), ("block", False), ("block", True))
HEAD_DIM, HEADS, KV_HEADS, SEQUENCE = 16, 4, 2, 16


def shape_for(k: int) -> DecoderConfig:
    """The block's shape for k ranks: 4 heads of 16 sharing 2 kv heads and a sequence of
    16 when they split evenly, else the next multiples of k, so every rank count runs."""
    # -(-a // b): ceiling division in integers; heads stays a multiple of kv_heads
    kv_heads = -(-KV_HEADS // k) * k
    heads = -(-HEADS // kv_heads) * kv_heads
    hidden = heads * HEAD_DIM
    return DecoderConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=4 * hidden,
                         seq_len=-(-SEQUENCE // k) * k)


def _case(kind: str, sequence_parallel: bool) -> Check:
    k, me = world_size(), rank()
    title = {"mlp": "tensor parallel: Megatron MLP (SwiGLU)",
             "block": "tensor parallel: decoder block"}[kind]
    title += ", sequence parallel" if sequence_parallel else ""
    c = shape_for(k)
    torch.manual_seed(0)  # nn.Linear's default init
    # seeded on the host, then moved: the same twin on any device
    twin = (SwiGLU(c.hidden, c.ffn, torch.float64) if kind == "mlp" else
            DecoderBlock(c, torch.float64))
    x = torch.randn(2, c.seq_len, c.hidden, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    twin, x = twin.to(device()), x.to(device())
    # the rotary tables cover the whole sequence on every rank (per position, not per token)
    rope = rope_tables(c.head_dim, torch.arange(c.seq_len, device=device()), c.rope_base,
                       torch.float64) if kind == "block" else ()
    reference = twin(x, *rope)
    parallel = ParallelSwiGLU(twin, sequence_parallel=sequence_parallel) if kind == "mlp" \
        else ParallelDecoderBlock(twin, sequence_parallel=sequence_parallel)
    # sequence parallel: each rank starts with its slice of the sequence (dim 1 of [batch,
    # seq, hidden]), as after a previous block's reduce-scatter
    local = x.chunk(k, 1)[me].contiguous() if sequence_parallel else x
    start = start_clock()
    with collectives.meter() as m:
        out = parallel(local, *rope)
        out.sum().backward()
    seconds = time.perf_counter() - start
    want = reference.chunk(k, 1)[me] if sequence_parallel else reference
    shape = "" if (c.heads, c.seq_len) == (HEADS, SEQUENCE) else \
        f"{c.heads} heads, sequence {c.seq_len} (to split over {k}); "
    # float64 twins: a tolerance of 1e-10 leaves room only for summation order
    return Check(title, bool(torch.allclose(out, want, rtol=1e-10)), seconds, m.sent_bytes,
                 note=f"{shape}output vs the one-process twin; speedups: minipar bench "
                      "tensor-parallel")


def demo(cases: tuple[tuple[str, bool], ...] = CASES) -> list[Check]:
    """On every rank: run each (block kind, sequence parallel) case forward and backward."""
    return [_case(*case) for case in cases]


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo)
