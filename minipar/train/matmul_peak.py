"""The peak a CPU run's MFU divides by: the rate one core reaches on the very kernels a
training step's model FLOPs run in, its matmuls and its fused attention.

A CPU has no data sheet figure for a given shape, thread count and dtype, and one large
square matmul is the wrong stand-in: it takes one kernel path while the model's tall,
thin projections may take another. bf16 on a CPU without AMX or AVX512-BF16 is the
sharp case: its 1024 x 1024 product ran 4.6x slower than the model's own smaller ones,
so a run "reached" 465% of that peak. Here the peak is timed on the model's shapes:
every projection of a block (q, k, v, o and the feed-forward's) and the head, at the rows
one pass multiplies (a micro-batch's sequences x seq_len tokens), each three ways, as
autograd runs it: forward `x @ W^T`, the input's gradient `g @ W`, the weight's `g^T @ x`.
Their FLOPs are exactly the 6N x tokens of MFU's formula (a test holds them equal). Each
product is timed in the four layouts its operands can be stored in, and the fastest
counts: which one autograd meets depends on the model's code, and on a CPU without fast
bf16 units one shape ran 7x faster in one layout than in another.

Each is timed at its best of several calls (one, where a call alone outlasts the
kernel's share of half a second), in the thread's CPU time (so a busy machine does not
lower it), and the matmuls' rate is their FLOPs over their best times, weighted as one
step calls them: the rate of a step that did nothing but its projections, each at its
fastest. Attention's 12 L T h FLOPs run in another kernel, fused
`scaled_dot_product_attention`, timed the same way at the model's shapes (forward and
backward, credited 12 T h FLOPs per token and layer as MFU counts them). The peak is the
faster of the two rates, so no part of a step can outrun it. Where attention is the
slower (fp32 and bf16 on the AVX2-only CPU measured), the peak is the matmuls' rate, and
how far attention falls short of it is part of what MFU shows.

Both guards come from one case: bf16 on an AVX2-only CPU, where the projections timed
only as autograd calls them ran at 5 GFLOP/s, slower than the fused attention (9) and
than the same products stored another way (up to 17), and one process's bf16 step
"reached" 102% of that peak. MFU above 1 means the measurement failed, and the run says
so. The rate as autograd calls them (`Rates.as_run`) is still what a run meets: the
warning before a slow low precision, and `minipar doctor`, compare those.

tp's narrower slices and cp's shorter sequences are not the peak's shapes: what they
lose against the whole model's matmuls shows as a lower MFU, as it should. Cached per
dtype, shapes, device (the CPU's model), CPU kind, threads and torch version.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ..decoder import DecoderConfig, attend
from ..runtime import cpu_kind, device, device_name, synchronize
from .data import cache_dir

# (name, FLOPs per call, calls per step, the ways to call it: the fastest one counts for
# the peak, the first is the way the model's code calls it)
Kernel = tuple[str, float, int, tuple[Callable[[], object], ...]]


class Rates(NamedTuple):
    """FLOP/s of a step's kernels: each the fastest of its ways (the peak's), and each the
    way the model's code calls it (what a run meets: the low-precision warning's)."""

    best: float
    as_run: float

# seconds of timed calls per kernel, shared by its ways: fast kernels get several calls
# (the first few run slower: fused attention's took 43, 33, 30, 26 ms after its warm-up)
KERNEL_BUDGET_S = 0.5

# on a GPU the peak is one large square product (the data sheet beside it): this
# size keeps a core's vector units busy; a GPU needs a far larger one to fill its SMs
SQUARE_SIZES = {"cpu": 1024, "cuda": 8192}


def step_matmuls(model: DecoderConfig, rows: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n, calls per step) of each forward projection one pass over `rows`
    sequences multiplies, x (m x k) @ W^T (k x n): a block's, called `layers` times, and
    the head's. Experts: the router, and each token's top_k experts' up and down, as
    m = tokens x top_k rows (their FLOPs; how the rows fall to experts is the run's)."""
    m, h = rows * model.seq_len, model.hidden
    kv = model.kv_heads * model.head_dim
    block = [("q", m, h, h), ("k", m, h, kv), ("v", m, h, kv), ("o", m, h, h)]
    if model.experts:
        routed = m * model.top_k
        block += [("router", m, h, model.experts), ("expert up", routed, h, model.ffn),
                  ("expert down", routed, model.ffn, h)]
    else:
        block += [("gate", m, h, model.ffn), ("up", m, h, model.ffn),
                  ("down", m, model.ffn, h)]
    return [(name, mm, k, n, model.layers) for name, mm, k, n in block] + \
        [("head", m, h, model.vocab_size, 1)]


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=device()).to(dtype)


def layouts(rows: int, inner: int, cols: int, dtype: torch.dtype,
            as_run: tuple[bool, bool]) -> tuple[Callable[[], object], ...]:
    """One product (rows x inner) @ (inner x cols), four ways: each operand stored as it is
    or transposed (a contiguous tensor read through .t()); first the way autograd meets
    it (`as_run`: which operands it reads transposed). Kernels differ by layout alone: on
    an AVX2-only CPU one bf16 shape ran at 1.7 to 12 GFLOP/s."""
    a, at = _randn(rows, inner, dtype=dtype), _randn(inner, rows, dtype=dtype)
    b, bt = _randn(inner, cols, dtype=dtype), _randn(cols, inner, dtype=dtype)
    ways = {(ta, tb): lambda ta=ta, tb=tb: (at.t() if ta else a) @ (bt.t() if tb else b)
            for ta in (False, True) for tb in (False, True)}
    first = ways.pop(as_run)
    return (first, *ways.values())


def step_kernels(model: DecoderConfig, rows: int, dtype: torch.dtype) -> list[Kernel]:
    """The matmuls of one training step's 6N term, on tensors of `dtype`: each projection's
    forward x @ W^T (m x k x n), input gradient g @ W (m x n x k) and weight gradient
    g^T @ x (n x m x k), each in every layout (`layouts`)."""
    kernels: list[Kernel] = []
    for name, m, k, n, calls in step_matmuls(model, rows):
        flops = 2 * m * k * n  # a multiply and an add per term
        # as autograd reads them: W^T is W read transposed, g^T is g read transposed
        kernels += [(f"{name} forward", flops, calls, layouts(m, k, n, dtype, (False, True))),
                    (f"{name} input grad", flops, calls, layouts(m, n, k, dtype, (False, False))),
                    (f"{name} weight grad", flops, calls, layouts(n, m, k, dtype, (True, False)))]
    return kernels


def attention_kernels(model: DecoderConfig, rows: int, dtype: torch.dtype) -> list[Kernel]:
    """One layer's causal attention over `rows` sequences, forward and backward, through
    the model's `decoder.attend` (kv heads repeated to the query heads, fused
    `scaled_dot_product_attention`; on contiguous heads, where the model passes
    transposed views), credited the 12 T h FLOPs per token MFU counts. Causal, the kernel
    skips about half of them, so its "rate" is about twice what the core did: a bound
    for the peak, as MFU counts, not a measure of the hardware."""
    def qkv(heads: int) -> torch.Tensor:
        x = _randn(rows, heads, model.seq_len, model.head_dim, dtype=dtype)
        return x.requires_grad_()

    q, k, v = qkv(model.heads), qkv(model.kv_heads), qkv(model.kv_heads)

    def forward_and_backward() -> None:
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    flops = 12 * model.seq_len * model.hidden * rows * model.seq_len
    return [("attention", flops, model.layers, (forward_and_backward,))]


def square_kernels(size: int, dtype: torch.dtype) -> list[Kernel]:
    """One size x size x size product: the peak where there is no model to time."""
    a, b = _randn(size, size, dtype=dtype), _randn(size, size, dtype=dtype)
    return [(f"{size}^3", 2 * size**3, 1, (lambda: a @ b,))]


def _clock() -> Callable[[], float]:
    """What a kernel's time is read from. On a CPU, the thread's own CPU time: the core's
    rate while it computes, not slowed when another process takes the core for a while
    (a peak timed on a busy machine would be too low, and MFU above 1 later). On a GPU
    the wall clock, after the queued work is done (`synchronize`)."""
    if device().type == "cpu":
        return time.thread_time
    return lambda: (synchronize(), time.perf_counter())[1]


def best_seconds(call: Callable[[], object], repeats: int = 10,
                 budget_s: float = KERNEL_BUDGET_S) -> float:
    """The fastest of up to `repeats` timed calls, as many as fit in `budget_s`, at least
    one (the caller warms the kernel up first). The fastest is the peak. A call slower than
    the budget is timed once: a step has about a hundred products to time, in four layouts
    each, and in a dtype the cores lack (bf16 on an AVX2-only CPU, about 0.2 s a call) a
    warm-up and three calls for each layout took 90 s for the small preset."""
    clock = _clock()
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < budget_s):
        start = clock()
        call()
        times.append(clock() - start)
    return min(times)


def kernels_rates(kernels: list[Kernel]) -> Rates:
    """FLOP/s of `kernels` as a step calls them, each at its fastest call: total FLOPs over
    the total of best times, taking each kernel's fastest way, and its first way."""
    flops = best = as_run = 0.0
    for _, per_call, calls, ways in kernels:
        # one untimed warm-up per kernel, its first way: allocation, one-time set-up, the
        # kernel's choice (a product's ways share its shapes; a way slow enough to be timed
        # once has little to set up beside its call)
        ways[0]()
        times = [best_seconds(call, budget_s=KERNEL_BUDGET_S / len(ways)) for call in ways]
        flops += per_call * calls
        best += min(times) * calls
        as_run += times[0] * calls
    return Rates(flops / best, flops / as_run)


def _peak_file() -> Path:
    return cache_dir() / "peak_flops.json"


def cached_rates(what: str, dtype: torch.dtype, make: Callable[[], list[Kernel]]) -> Rates:
    """`kernels_rates(make())`, measured once per `what`, dtype and machine (the device,
    the CPU's model and kind, threads, torch version) and kept in peak_flops.json."""
    key = f"{what}|{dtype}|threads={torch.get_num_threads()}|{device_name()}|" \
          f"{cpu_kind()}|torch {torch.__version__}|best, as run"
    path = _peak_file()
    saved = json.loads(path.read_text()) if path.exists() else {}
    if key not in saved:
        saved[key] = list(kernels_rates(make()))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".tmp-{os.getpid()}")
        partial.write_text(json.dumps(saved, indent=1))
        partial.replace(path)  # atomic: two ranks measuring at once never leave half a file
    return Rates(*saved[key])


def matmul_rates(dtype: torch.dtype, model: DecoderConfig, rows: int) -> Rates:
    """FLOP/s of `model`'s projections at `rows` sequences per pass, each at its best: in
    its fastest layout, and in the layout autograd meets."""
    # the shapes themselves are the key: two models with the same matmuls share a rate
    what = "matmuls " + str(step_matmuls(model, rows))
    return cached_rates(what, dtype, lambda: step_kernels(model, rows, dtype))


def attention_rate(dtype: torch.dtype, model: DecoderConfig, rows: int) -> float:
    """FLOP/s of `model`'s fused attention at `rows` sequences per pass, at its best."""
    what = (f"attention rows={rows} heads={model.heads} kv_heads={model.kv_heads} "
            f"seq={model.seq_len} head_dim={model.head_dim}")
    return cached_rates(what, dtype, lambda: attention_kernels(model, rows, dtype)).best


def model_peak(dtype: torch.dtype, model: DecoderConfig, rows: int) -> float:
    """The peak of a run of `model` with `rows` sequences per pass: the faster of its
    matmuls' rate and its attention's (module docstring)."""
    return max(matmul_rates(dtype, model, rows).best, attention_rate(dtype, model, rows))


def square_peak(dtype: torch.dtype, size: int | None = None) -> float:
    """FLOP/s of one large square product (SQUARE_SIZES for the device type)."""
    size = size or SQUARE_SIZES.get(device().type, SQUARE_SIZES["cpu"])
    return cached_rates(f"square {size}", dtype, lambda: square_kernels(size, dtype)).best
