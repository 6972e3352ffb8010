"""KARMA's choice, layer by layer, between swapping a layer's saved activations to the host
and recomputing them (Wahib et al., SC'20), from a cost model fitted on this machine.

The cost model has two fitted lines, each `cost.fit_alpha_beta` over real measurements:

- the copy link (`fit_copy`): seconds = latency + bytes / bandwidth, timed on copies of a
  few sizes between a device buffer and a host one, as the machine's network is fitted;
- the compute (`fit_compute`): seconds = latency + FLOPs / rate, timed on the model's own
  layers' forward at a few batch sizes, FLOPs counted by torch's FlopCounterMode.

A swapped layer copies its activations out during forward and in during backward: two
copies. With prefetch they run beside the next layer's forward and backward (about three
of its forwards), so only what exceeds that window is paid. A recomputed layer pays one
more forward of itself, in full, and still keeps its input. Keeping costs nothing but
memory. The plan keeps every layer while the activations fit what the budget leaves;
above it, from the first layer on (its activations wait longest for their backward), each
layer gets the cheaper of swap and recompute until what stays fits (and if the inputs
recomputed layers keep are still too much, those layers swap instead).

Leaving out latencies and overlap, recompute beats swap where FLOPs / rate < 2 x bytes /
bandwidth: below an arithmetic intensity of 2 x rate / bandwidth FLOPs per saved byte
(`recompute_threshold`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..cost import Link, fit_alpha_beta
from ..runtime import device, host_empty_like, on_copy_stream
from .fsdp import default_units
from .memory_tracker import mib
from .zero import trainable_parameters

COPY_SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
SWAP_WINDOW = 3  # a layer's forward + backward is about three forwards: what a swap can hide in


@dataclass(frozen=True)
class Compute:
    """Seconds to run `flops`: a fixed cost per layer call plus FLOPs at `rate` FLOP/s."""

    latency: float
    rate: float

    def seconds(self, flops: float) -> float:
        return self.latency + flops / self.rate


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocation and kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_copy(sizes: list[int] = COPY_SIZES, repeats: int = 5) -> Link:
    """The host<->device copy link, fitted to timed copies of `sizes` bytes (on the copy
    stream, from a host buffer into the device; on CPU, memory into memory)."""
    seconds = []
    for nbytes in sizes:
        src = host_empty_like(torch.empty(nbytes // 4, device=device()))
        dst = torch.empty(nbytes // 4, device=device())

        def copy(src=src, dst=dst):
            with on_copy_stream():
                dst.copy_(src, non_blocking=True)

        seconds.append(_median_seconds(copy, repeats))
    latency, beta = fit_alpha_beta([float(s) for s in sizes], seconds)
    return Link(latency, 1 / beta if beta > 0 else float("inf"))


@dataclass(frozen=True)
class LayerProfile:
    """What one layer saves for backward (bytes, and of them its input's) and its forward
    FLOPs, measured on one forward. Counted per layer: a tensor two layers save (one's
    output, the next one's input) counts in both, so a plan errs on the safe side."""

    index: int
    saved_bytes: int
    input_bytes: int
    flops: float


def profile(module: nn.Module, x: torch.Tensor) -> list[LayerProfile]:
    """Each layer's saved activations (parameters left out) and forward FLOPs on input `x`."""
    units = default_units(module)
    saved, inputs, current = [0] * len(units), [0] * len(units), [None]
    weights = {p.untyped_storage().data_ptr() for p in trainable_parameters(module)}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in weights and ptr not in seen:
            seen.add(ptr)  # each storage once per layer, as the MemoryTracker counts
            saved[current[0]] += t.untyped_storage().nbytes()
        return t

    def enter(i: int, args: tuple) -> None:
        current[0] = i
        seen.clear()
        inputs[i] = sum(a.untyped_storage().nbytes() for a in args
                        if isinstance(a, torch.Tensor))

    handles = [u.register_forward_pre_hook(lambda _m, a, i=i: enter(i, a))
               for i, u in enumerate(units)]
    handles += [u.register_forward_hook(lambda *_: current.__setitem__(0, None)) for u in units]
    # the layers' FLOPs, read by their names in the counter's per-module breakdown
    names = {id(m): n for n, m in module.named_children()}
    try:
        with FlopCounterMode(display=False) as counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
    finally:
        for h in handles:
            h.remove()
    counts = counter.get_flop_counts()
    top = type(module).__name__
    return [LayerProfile(i, saved[i], inputs[i],
                         float(sum(counts.get(f"{top}.{names[id(u)]}", {}).values())))
            for i, u in enumerate(units)]


def fit_compute(module: nn.Module, x: torch.Tensor, repeats: int = 5) -> Compute:
    """Seconds per layer forward as latency + FLOPs / rate, fitted to every layer's forward
    timed at the full batch and at a quarter and a half of it."""
    flops, seconds = [], []
    with torch.no_grad():
        for rows in sorted({max(1, len(x) // 4), max(1, len(x) // 2), len(x)}):
            part = x[:rows]
            for layer, info in zip(default_units(module), profile(module, part), strict=True):
                if info.flops:
                    flops.append(info.flops)
                    seconds.append(_median_seconds(lambda f=layer, a=part: f(a), repeats))
                part = layer(part)
    latency, per_flop = fit_alpha_beta(flops, seconds)
    return Compute(latency, 1 / per_flop if per_flop > 0 else float("inf"))


def recompute_threshold(copy: Link, compute: Compute) -> float:
    """FLOPs per saved byte below which recomputing a layer is cheaper than copying its
    activations out and back in (latencies and overlap left out): 2 x rate / bandwidth."""
    return 2 * compute.rate / copy.bandwidth


@dataclass(frozen=True)
class LayerChoice:
    """One layer's costs under the model and the plan's choice for it."""

    layer: LayerProfile
    swap_seconds: float  # two copies, what the next layer's compute leaves unhidden
    recompute_seconds: float  # one more forward of the layer
    choice: str


@dataclass(frozen=True)
class SwapPlan:
    """KARMA's plan: per layer keep, swap or recompute; `choices` is what `Offload` takes."""

    layers: list[LayerChoice]
    activation_budget: int

    @property
    def choices(self) -> list[str]:
        return [c.choice for c in self.layers]

    def held_bytes(self) -> int:
        """Activation bytes the device still holds under the plan."""
        return sum(_held(c.layer, c.choice) for c in self.layers)

    def __str__(self) -> str:
        lines = [f"activations may hold {mib(self.activation_budget)}; the plan holds "
                 f"{mib(self.held_bytes())}",
                 "layer   saved MiB   FLOPs/byte   swap ms   recompute ms   choice"]
        for c in self.layers:
            p = c.layer
            lines.append(f"{p.index:>5}   {p.saved_bytes / 2**20:9.2f}   "
                         f"{p.flops / max(p.saved_bytes, 1):10.1f}   "
                         f"{c.swap_seconds * 1e3:7.3f}   {c.recompute_seconds * 1e3:12.3f}   "
                         f"{c.choice}")
        return "\n".join(lines)


def _held(layer: LayerProfile, choice: str) -> int:
    return {"keep": layer.saved_bytes, "swap": 0, "recompute": layer.input_bytes}[choice]


def plan(layers: list[LayerProfile], copy: Link, compute: Compute, activation_budget: int,
         prefetch: bool = True) -> SwapPlan:
    """Keep, swap or recompute per layer so that the kept activations fit
    `activation_budget` bytes at the least modelled cost (see the module docstring)."""
    costs = []
    for i, layer in enumerate(layers):
        copies = 2 * copy.seconds(layer.saved_bytes)
        # prefetch hides the copies behind the next layer's forward and backward, if any
        window = SWAP_WINDOW * compute.seconds(layers[i + 1].flops) \
            if prefetch and i + 1 < len(layers) else 0.0
        costs.append((max(copies - window, 0.0), compute.seconds(layer.flops)))
    choices = ["keep"] * len(layers)
    held = sum(layer.saved_bytes for layer in layers)
    for i, layer in enumerate(layers):
        if held <= activation_budget:
            break
        swap, again = costs[i]
        choices[i] = "swap" if swap <= again else "recompute"
        held -= layer.saved_bytes - _held(layer, choices[i])
    for i, layer in enumerate(layers):  # a recomputed layer still keeps its input: swap it
        if held > activation_budget and choices[i] == "recompute":
            choices[i], held = "swap", held - layer.input_bytes
    if held > activation_budget:
        raise ValueError(f"activation_budget={mib(activation_budget)} cannot hold even the "
                         f"plan that swaps or recomputes every layer ({mib(held)}); raise the "
                         "budget")
    return SwapPlan([LayerChoice(layer, s, r, c) for layer, (s, r), c
                 in zip(layers, costs, choices, strict=True)], activation_budget)
