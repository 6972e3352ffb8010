"""Training beyond the device's memory: layers' parameters, optimizer state and saved
activations kept in host memory and brought in as they are needed (KARMA, Wahib et al.
SC'20; ZeRO-Offload, Ren et al. 2021, for the states).

The model is cut into layers (its top-level children, as FSDP's units). Per layer, its
saved activations are either kept on the device ("keep"), copied out to the host during
forward and back in during backward ("swap"), or dropped and rebuilt by running the
layer's forward again in backward ("recompute", `memory.recompute`). With
`states="host"` the parameters' master copy and the optimizer live in host memory: a
layer's parameters come in for its forward, leave, come in again for its backward, and
its gradients go out as soon as they are done; the optimizer steps on the host.

With `prefetch` the copies run on a `CopyStream` (a second CUDA stream on a GPU, a
background thread on CPU) one layer ahead: layer i+1's parameters load while layer i
computes forward, layer i-1's parameters and activations while layer i computes
backward, so the copies hide behind compute as far as compute lasts. A layer waits for
the copies out of the layer two before it (its activations in forward, its gradients in
backward) before it computes, so at most two layers' worth are in flight however far the
copies fall behind: what bounds the device's peak. Without prefetch every copy runs when
it is needed, on the compute's own thread. `timeline_rows` draws both
on SE-MoE's rows (`trace.STREAMS`: compute above copy) and `hidden_fraction` measures the overlap.

A device budget (bytes) is checked up front, where no layer could fit, and at every
sample of the `MemoryTracker` that `tracker()` builds.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch import nn

from ..runtime import device
from ..trace import STREAMS, Event, Timeline, add_event, now, overlap_length, subtract, union_length
from .fsdp import default_units
from .memory_tracker import MemoryTracker, _watching, mib, recompute
from .swap import CopyStream, SavedBox, SwappedLayer
from .zero import OptimizerFactory, trainable_parameters

CHOICES = ("keep", "swap", "recompute")
STATES = ("device", "host")


def layer_bytes(units: Sequence[nn.Module]) -> list[int]:
    """Bytes of each layer's trainable parameters."""
    return [sum(p.numel() * p.element_size() for p in trainable_parameters(u)) for u in units]


def check_budget(budget: int | None, units: Sequence[nn.Module], states: str) -> None:
    """Refuse, in one line, a budget that cannot hold what must be on the device at once:
    one layer's parameters and gradients (states on the host), or all of them (states on
    the device)."""
    if budget is None:
        return
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be None or a positive int of bytes; got {budget!r}")
    sizes = layer_bytes(units)
    if states == "device" and 2 * sum(sizes) > budget:
        raise ValueError(f"budget={mib(budget)} cannot hold the parameters and gradients "
                         f"({mib(2 * sum(sizes))}) on the device; pass states='host' or raise "
                         "budget")
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    if 2 * sizes[largest] > budget:
        raise ValueError(f"budget={mib(budget)} cannot hold one layer: layer {largest} needs "
                         f"{mib(2 * sizes[largest])} (parameters and gradients); raise budget to "
                         "at least that or cut the layer smaller")


def _check_plan(activations: str | Sequence[str], layers: int) -> list[str]:
    plan = [activations] * layers if isinstance(activations, str) else list(activations)
    if len(plan) != layers or any(c not in CHOICES for c in plan):
        raise ValueError(f"activations must be one of {CHOICES} or a list of them, one per "
                         f"layer ({layers} layers); got {activations!r}")
    return plan


class Offload:
    """Train `module` with its layers' activations kept, swapped or recomputed (`activations`:
    one choice for all, or a plan with one per layer), its parameters and optimizer state on
    the device or the host (`states`), copies prefetched or not. Use it like the module:
    `off(x)`, `loss.backward()`, `off.step()`. `optimizer` builds the optimizer from a list
    of parameters (the host's flat masters when `states="host"`)."""

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory,
                 activations: str | Sequence[str] = "keep", states: str = "device",
                 prefetch: bool = True, budget: int | None = None) -> None:
        if states not in STATES:
            raise ValueError(f"states must be one of {STATES}; got {states!r}")
        units = default_units(module)
        if not units:
            raise ValueError("module has no child layer with parameters to offload")
        inside = {id(p) for u in units for p in trainable_parameters(u)}
        if any(id(p) not in inside for p in trainable_parameters(module)) or \
                len(inside) != sum(len(trainable_parameters(u)) for u in units):
            raise ValueError("every trainable parameter must belong to exactly one top-level "
                             "child layer (no tied or loose parameters)")
        check_budget(budget, units, states)
        self.module, self.units, self.budget, self.prefetch = module, units, budget, prefetch
        self.plan = _check_plan(activations, len(units))
        self.stream = CopyStream(background=prefetch)
        self.layers = [SwappedLayer(u, i) for i, u in enumerate(units)] \
            if states == "host" else []
        self._boxes: list[list[weakref.ref]] = [[] for _ in units]
        self._owed = [len(trainable_parameters(u)) for u in units]
        self._current: int | None = None
        self._param_storages: set[int] = set()
        self._started = [0.0] * len(units)
        self._outbound: list[list[Future]] = [[] for _ in units]  # copies out, per layer
        for i, unit in enumerate(units):
            if self.plan[i] == "recompute":
                recompute([unit])
            unit.register_forward_pre_hook(lambda _m, _a, i=i: self._before_forward(i))
            unit.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out))
            for p in trainable_parameters(unit):
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._arrived(i))
        for layer in self.layers:
            layer.evict()
        self.optimizer = optimizer([layer.host for layer in self.layers] if self.layers
                                   else trainable_parameters(module))

    def tracker(self) -> MemoryTracker:
        """A MemoryTracker of what is on the device, enforcing this offload's budget."""
        return MemoryTracker(self.module, None if self.layers else self.optimizer,
                             budget=self.budget)

    def __call__(self, *args, **kwargs):
        # the unpack hook travels with each saved tensor: backward uses it outside this block
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _sample(self, label: str) -> None:
        for tracker in _watching:  # the moments a layer has just come in: the peaks
            tracker.sample(label)

    def _drain(self, i: int) -> None:
        """Wait for layer i's copies out (no-op outside the layers)."""
        if 0 <= i < len(self.units):
            for future in self._outbound[i]:
                self.stream.wait(future, f"wait out L{i}")
            self._outbound[i] = []

    def _before_forward(self, i: int) -> None:
        self._started[i] = now()
        self._drain(i - 2)  # at most two layers' activations on their way out
        if self.layers:
            self.layers[i].load(self.stream)
            if self.prefetch and i + 1 < len(self.layers):
                self.layers[i + 1].prefetch(self.stream)  # layer i+1 loads while i computes
        self._current = i
        # what a layer's forward saves of its own weights is no activation: never swap it
        self._param_storages = {p.untyped_storage().data_ptr()
                                for p in trainable_parameters(self.units[i])}
        self._sample(f"forward L{i}")

    def _after_forward(self, i: int, output: object) -> None:
        add_event("compute", f"F{i}", self._started[i], now(), stage=i)
        self._current, self._param_storages = None, set()
        if self.layers:
            self.layers[i].evict()
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # fires when backward reaches the layer's output: just before its backward
                t.register_hook(lambda _g, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._drain(i + 2)  # at most two layers' gradients on their way out
        if self.layers:
            self.layers[i].load(self.stream)
        if self.prefetch:
            self._fetch_activations(i)  # the last layer's, when nothing fetched them yet
            if i > 0:  # layer i-1 computes next: bring it in while layer i computes
                if self.layers:
                    self.layers[i - 1].prefetch(self.stream)
                self._fetch_activations(i - 1)
        self._sample(f"backward L{i}")
        self._started[i] = now()

    def _fetch_activations(self, i: int) -> None:
        for ref in self._boxes[i]:
            box = ref()
            if box is not None:
                box.prefetch(self.stream, device())

    def _arrived(self, i: int) -> None:
        self._owed[i] -= 1
        if self._owed[i]:
            return
        self._owed[i] = len(trainable_parameters(self.units[i]))
        add_event("compute", f"B{i}", self._started[i], now(), stage=i)
        self._boxes[i] = []
        self._sample(f"backward L{i} done")  # the layer and all its gradients on the device
        if self.layers:
            for tracker in _watching:  # gradients on their way out still hold device memory
                for p in self.layers[i].params:
                    tracker.keep(p.grad)
            self._outbound[i].append(self.layers[i].send_gradients(self.stream))
            self.layers[i].evict()

    def _pack(self, t: torch.Tensor) -> object:
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self._param_storages:
            return t  # a weight: the tracker counts it as a parameter
        box = SavedBox(t, self._current)  # layer None: saved outside the layers, kept
        for tracker in _watching:
            tracker.track_saved(box)
        if self._current is not None and self.plan[self._current] == "swap":
            self._boxes[self._current].append(weakref.ref(box))
            self._outbound[self._current].append(box.swap_out(self.stream))
        return box

    def _unpack(self, saved: object) -> torch.Tensor:
        return saved.unpack(self.stream, device()) if isinstance(saved, SavedBox) else saved

    def step(self) -> None:
        """Wait for the gradients' copies, update (on the host with states="host"), and start
        loading the first layer for the next forward."""
        self.stream.join()
        self._outbound = [[] for _ in self.units]
        for layer in self.layers:
            layer.hand_gradient_to_optimizer()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.layers and self.prefetch:
            self.layers[0].prefetch(self.stream)

    def gather_parameters(self) -> None:
        """Every layer's parameters on the device (to read or compare them)."""
        self.stream.join()
        for layer in self.layers:
            layer.load(self.stream)


def _computing(timeline: Timeline) -> list[tuple[float, float]]:
    """When a layer computed: its compute events less the waits for copies and the copies
    run on the compute's own thread (no prefetch), which stop it."""
    threads = {e.thread for e in timeline if e.kind == "compute"}
    stops = [(e.start, e.end) for e in timeline
             if e.kind == "wait" or (e.kind == "copy" and e.thread in threads)]
    return subtract([(e.start, e.end) for e in timeline if e.kind == "compute"], stops)


def timeline_rows(timeline: Timeline) -> Timeline:
    """One rank's events on the rows SE-MoE's schedules use (`trace.STREAMS`):
    layers computing on "compute" (cut where they stopped for a copy), copies on "copy"."""
    row = STREAMS.index("compute")
    rows = [Event(STREAMS.index("copy"), "copy", e.label, e.start, e.end, bytes=e.bytes)
            for e in timeline if e.kind == "copy"]
    busy = _computing(timeline)
    for e in timeline:
        if e.kind == "compute":
            for start, end in busy:
                if start < e.end and end > e.start:
                    rows.append(Event(row, "compute", e.label, max(start, e.start),
                                      min(end, e.end), stage=e.stage))
    return Timeline(rows)


def hidden_fraction(timeline: Timeline) -> float:
    """Share of copy time that ran while a layer computed: 1.0 is every copy hidden behind
    compute, 0.0 none (no prefetch: each copy stops the compute)."""
    copies = [(e.start, e.end) for e in timeline if e.kind == "copy"]
    total = union_length(copies)
    return overlap_length(copies, _computing(timeline)) / total if total else 0.0
