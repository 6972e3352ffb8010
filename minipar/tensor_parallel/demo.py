"""The tensor-parallel demo: the Megatron MLP and a transformer block (with and without
sequence parallelism) split over the ranks, each rank checking its output against the
one-process twin. `python -m minipar.tensor_parallel`, `minipar tour` and the tests run
`demo`."""

from __future__ import annotations

import time

import torch

from .. import collectives
from ..demo import Check, Context, Row, start_clock
from ..models import FFN, TransformerBlock
from ..runtime import device, rank, world_size
from .layers import ParallelMLP, ParallelTransformerBlock

CASES = (("mlp", False), ("block", False), ("block", True))
HEAD_DIM, HEADS, SEQUENCE = 16, 4, 16


def shape_for(k: int) -> tuple[int, int, int]:
    """(hidden, heads, sequence) for k ranks: 4 heads of 16 and a sequence of 16 when they
    split evenly, else the next multiples of k, so every rank count runs."""
    # -(-a // b): ceiling division in integers
    heads = -(-HEADS // k) * k
    return heads * HEAD_DIM, heads, -(-SEQUENCE // k) * k


def _case(kind: str, sequence_parallel: bool) -> Check:
    k, me = world_size(), rank()
    title = {"mlp": "tensor parallel: Megatron MLP",
             "block": "tensor parallel: transformer block"}[kind]
    title += ", sequence parallel" if sequence_parallel else ""
    hidden, heads, sequence = shape_for(k)
    torch.manual_seed(0)
    twin = (FFN(hidden, 4 * hidden, torch.float64) if kind == "mlp" else
            TransformerBlock(hidden, heads, 4 * hidden, seed=0, dtype=torch.float64)).to(device())
    x = torch.randn(sequence, 2, hidden, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1)).to(device())
    reference = twin(x)
    parallel = ParallelMLP(twin, sequence_parallel=sequence_parallel) if kind == "mlp" \
        else ParallelTransformerBlock(twin, sequence_parallel=sequence_parallel)
    # sequence parallel: each rank starts with its slice of the sequence (dim 0), as after a
    # previous block's reduce-scatter
    local = x.chunk(k, 0)[me].contiguous() if sequence_parallel else x
    start = start_clock()
    with collectives.meter() as m:
        out = parallel(local)
        out.sum().backward()
    seconds = time.perf_counter() - start
    want = reference.chunk(k, 0)[me] if sequence_parallel else reference
    shape = "" if (heads, sequence) == (HEADS, SEQUENCE) else \
        f"{heads} heads, sequence {sequence} (to split over {k}); "
    # float64 twins: a tolerance of 1e-10 leaves room only for summation order
    return Check(title, bool(torch.allclose(out, want, rtol=1e-10)), seconds, m.sent_bytes,
                 note=f"{shape}output vs the one-process twin; speedups: minipar bench "
                      "tensor-parallel")


def demo(cases: tuple[tuple[str, bool], ...] = CASES) -> list[Check]:
    """On every rank: run each (block kind, sequence parallel) case forward and backward."""
    return [_case(*case) for case in cases]


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo)
