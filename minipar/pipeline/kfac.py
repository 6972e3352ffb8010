"""PipeFisher: K-FAC's curvature work run in a pipeline's bubbles.

K-FAC (Martens and Grosse, 2015) preconditions each linear layer's gradient with two
small Kronecker factors instead of the full Fisher matrix: A = E[a a^T] over the layer's
inputs a (a 1 appended for the bias) and G = E[g g^T] over the gradients g of its outputs
(per sample, so scaled by the batch size N). The update direction is
(G + damping I)^-1 grad (A + damping I)^-1.

PipeFisher (Osawa et al., 2023) notices that building those factors and inverting them
is work a pipeline's idle ranks could do: it profiles one step, finds the bubbles, and
places the curvature work in them. Here `KFAC` keeps each micro-batch's a and g as the
pipeline runs, and turns the last step's into work units (one factor contribution per
layer and micro-batch, then one inversion per factor). `Pipeline.fill_bubbles` with a
`pipefisher.BubbleWork` runs units before the receives where the simulator, fed measured
costs, says the rank would wait. Whatever does not fit runs after the step. With
`every=1` the gradients of step t are preconditioned with the inverses built from step
t-1's statistics (step 0 with its own); with `every=k` the curvature is refreshed every k
steps and its work spread over k steps' bubbles, as PipeFisher does when one step's
bubbles are too small. Damping is plain Tikhonov on both factors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..trace import record


class _Layer:
    """One nn.Linear: what it kept this step, its factors, and their inverses."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self.inputs: list[torch.Tensor] = []  # a, per micro-batch, bias column included
        self.output_grads: list[torch.Tensor] = []  # dL/dy per micro-batch (not yet x N)
        self.inverse_a: torch.Tensor | None = None
        self.inverse_g: torch.Tensor | None = None

    def keep_input(self, x: torch.Tensor) -> None:
        a = x.detach().reshape(-1, x.shape[-1])
        if self.module.bias is not None:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        self.inputs.append(a)

    def preconditioned(self, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        grad = weight_grad if bias_grad is None else torch.cat([weight_grad,
                                                                bias_grad[:, None]], dim=1)
        direction = self.inverse_g @ grad @ self.inverse_a
        if bias_grad is None:
            return direction, None
        return direction[:, :-1], direction[:, -1]


class KFAC:
    """K-FAC for every nn.Linear in `modules` (this rank's pipeline stages), its curvature
    work cut into units that can fill a pipeline's bubbles (see the module docstring)."""

    def __init__(self, modules: Iterable[nn.Module], damping: float = 1e-3) -> None:
        if not damping > 0:
            raise ValueError(f"damping must be > 0 (added to each factor's diagonal); "
                             f"got {damping!r}")
        self.damping = damping
        self.layers = [_Layer(m) for module in modules for m in module.modules()
                       if isinstance(m, nn.Linear)]
        if not self.layers:
            raise ValueError("K-FAC preconditions nn.Linear layers and these modules have none")
        self._units: list[tuple[str, Callable[[], None]]] = []
        self._sums: dict[tuple[int, str], torch.Tensor] = {}
        self._staged: dict[tuple[int, str], torch.Tensor] = {}
        self._expected: dict[str, float] = {}  # unit kind ("A0", "invG1") -> last seconds
        self.units_in_bubbles = self.units_after_step = 0
        self.seconds = 0.0  # spent on curvature work so far
        for layer in self.layers:
            layer.module.register_forward_hook(self._forward_hook(layer))

    def _forward_hook(self, layer: _Layer):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if not torch.is_grad_enabled() or not output.requires_grad:
                return
            layer.keep_input(inputs[0])
            kept = []

            def keep_grad(grad: torch.Tensor) -> None:
                if not kept:  # a split backward (I, then W) passes through twice
                    kept.append(True)
                    layer.output_grads.append(grad.detach().reshape(-1, grad.shape[-1]))

            output.register_hook(keep_grad)
        return hook

    # --- the curvature work, as units ---

    def end_step(self) -> None:
        """Turn this step's kept inputs and output gradients into the next units of work
        (queued behind any left over), and forget them."""
        rows = sum(a.shape[0] for a in self.layers[0].inputs)
        for i, layer in enumerate(self.layers):
            inputs, grads = layer.inputs, layer.output_grads
            layer.inputs, layer.output_grads = [], []
            if len(inputs) != len(grads):
                raise RuntimeError(f"layer {i} kept {len(inputs)} inputs but {len(grads)} "
                                   "output gradients: was a backward skipped?")
            for c, (a, g) in enumerate(zip(inputs, grads, strict=True)):
                self._units.append((f"A{i}.{c}", self._add(i, "A", a, 1.0 / rows)))
                self._units.append((f"G{i}.{c}", self._add(i, "G", g, float(rows))))
            self._units.append((f"invA{i}", self._invert(i, "A")))
            self._units.append((f"invG{i}", self._invert(i, "G")))

    def _add(self, i: int, which: str, rows: torch.Tensor, scale: float) -> Callable[[], None]:
        def unit() -> None:  # E[a a^T] = sum a^T a / N; E[g g^T] with g = N dL/dy
            contribution = rows.T @ rows * scale
            key = (i, which)
            self._sums[key] = contribution if key not in self._sums \
                else self._sums[key] + contribution
        return unit

    def _invert(self, i: int, which: str) -> Callable[[], None]:
        def unit() -> None:
            factor = self._sums.pop((i, which))
            if not torch.isfinite(factor).all():
                raise FloatingPointError(f"K-FAC's {which} factor of layer {i} is not finite: "
                                         "training diverged; lower lr or raise damping")
            wide = factor.double()  # float32 factors can lose definiteness in rounding
            damped = wide + self.damping * torch.eye(wide.shape[0], dtype=wide.dtype,
                                                     device=wide.device)
            cholesky, info = torch.linalg.cholesky_ex(damped)
            if info.item() == 0:  # the cheap way: a Cholesky factor, then its inverse
                inverse = torch.cholesky_inverse(cholesky)
            else:  # rounding made an eigenvalue negative: clip them at 0, then invert
                values, vectors = torch.linalg.eigh(wide)
                inverse = (vectors / (values.clamp(min=0) + self.damping)) @ vectors.T
            inverse = inverse.to(factor.dtype)
            self._staged[(i, which)] = inverse  # published by finish(), not mid-interval
        return unit

    def work(self, seconds: float) -> float:
        """Run queued units, in order, while the next one is expected to fit in what is
        left of `seconds` (its kind's last measured time; a kind never measured waits for
        finish()); returns the seconds spent. What a bubble calls."""
        spent = 0.0
        while self._units:
            expected = self._expected.get(_kind(self._units[0][0]))
            if expected is None or spent + expected > seconds:
                break
            spent += self._run_one()
            self.units_in_bubbles += 1
        return spent

    def finish(self) -> None:
        """Run every unit still queued (what did not fit in the bubbles) and start using
        the inverses they built."""
        while self._units:
            self._run_one()
            self.units_after_step += 1
        for (i, which), inverse in self._staged.items():
            setattr(self.layers[i], "inverse_a" if which == "A" else "inverse_g", inverse)
        self._staged = {}

    def forget(self) -> None:
        """Drop what this step kept (a step whose curvature is not used)."""
        for layer in self.layers:
            layer.inputs, layer.output_grads = [], []

    def _run_one(self) -> float:
        name, unit = self._units.pop(0)
        start = time.perf_counter()
        with record("K-FAC", name):
            unit()
        spent = time.perf_counter() - start
        self.seconds += spent
        self._expected[_kind(name)] = spent
        return spent

    # --- using it ---

    @torch.no_grad()
    def precondition(self) -> None:
        """Replace each layer's .grad by K-FAC's direction, with the newest inverses."""
        for layer in self.layers:
            if layer.inverse_a is None or layer.inverse_g is None:
                raise RuntimeError("no curvature yet: call end_step() and finish() after the "
                                   "first step before preconditioning")
            weight, bias = layer.module.weight, layer.module.bias
            w, b = layer.preconditioned(weight.grad, None if bias is None else bias.grad)
            weight.grad.copy_(w)
            if bias is not None:
                bias.grad.copy_(b)


def _kind(name: str) -> str:
    """A unit's kind: its name without the micro-batch ("A0.3" -> "A0")."""
    return name.split(".")[0]


def kfac_step(kfac: KFAC, step: int, every: int = 1) -> None:
    """The bookkeeping around one training step's gradients, the same in a pipeline and in
    one process. Curvature is refreshed from every `every`-th step's statistics: their
    units fill the bubbles of the `every` steps that follow, the rest runs at the end of
    the last of them, and only then are the new inverses used (so the result does not
    depend on what fitted where). On step 0 the inverses are built at once: there are no
    earlier statistics. Then the gradients are preconditioned."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1 (steps between curvature refreshes); "
                         f"got {every!r}")
    if step == 0:
        kfac.end_step()
        kfac.finish()
    elif step % every == 0:
        kfac.finish()  # the previous refresh's units the bubbles left over
        kfac.end_step()
    else:
        kfac.forget()
    kfac.precondition()
