"""FP8 training, emulated: the numerics of an 8-bit matmul on any machine.

An FP8 recipe (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; NVIDIA's
TransformerEngine, torchao's float8) runs the large matmuls with 8-bit inputs and keeps
everything else wider:

- forward, the activation and the weight go in as **e4m3** (4 exponent bits, 3 mantissa
  bits, largest value 448): precision over range;
- backward, the incoming gradient goes in as **e5m2** (largest 57344): range over
  precision, since gradients span more orders of magnitude;
- each tensor has its own **scale**, chosen so that its largest magnitude lands on the
  format's largest value (per-tensor "current" scaling, torchao's tensorwise recipe;
  TransformerEngine's default delays it, using the amax of earlier steps);
- the products **accumulate in float32**, and the output is float32 (a GPU's tensor cores
  do the same in hardware).

Here each 8-bit tensor is emulated: scaled, cast to torch's float8 dtype (the rounding a
GPU would do), cast back and unscaled, and the matmul then runs in float32. So the loss
and the gradients are what FP8 hardware computes, up to the order of the float32 sums;
the speed is float32's. On a CPU this is for numerics, not speed.

Which matmuls: the blocks' linear layers (attention's projections and the feed-forward).
The embedding, the output head and a mixture's router stay in float32, as
TransformerEngine's recipes keep the first and last layers in higher precision; the
attention scores' matmuls are not linear layers and stay in float32 too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..pipeline import Stage

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantize(x: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """`x` as an 8-bit tensor of `dtype` would hold it, in x's dtype: scaled so its
    largest magnitude is the format's largest value, rounded to the format, unscaled."""
    amax = x.detach().abs().max()
    if amax == 0 or not torch.isfinite(amax):
        return x  # nothing to scale (an overflow shows itself in the float32 sums)
    scale = torch.finfo(dtype).max / amax.float()
    return ((x.float() * scale).to(dtype).float() / scale).to(x.dtype)


class Fp8Linear(torch.autograd.Function):
    """F.linear with e4m3 inputs in forward and an e5m2 gradient in backward, float32
    products; backward uses the quantized copies forward saved (what an FP8 GEMM reads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,  # noqa: ANN001
                bias: torch.Tensor | None) -> torch.Tensor:
        xq, wq = quantize(x), quantize(weight)
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = bias is not None
        return nn.functional.linear(xq, wq, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        xq, wq = ctx.saved_tensors
        gq = quantize(grad, E5M2)
        grad_x = gq @ wq
        grad_w = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


class Fp8Matmuls(TorchFunctionMode):
    """Inside it, every F.linear whose weight is one of `weights` runs as `Fp8Linear`;
    other calls run as they are."""

    def __init__(self, weights: Iterable[nn.Parameter]) -> None:
        super().__init__()
        self.weights = {id(w) for w in weights}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is nn.functional.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if id(weight) in self.weights:
                return Fp8Linear.apply(x, weight, bias)
        return func(*args, **kwargs)


def fp8_weights(module: nn.Module, keep: tuple[type, ...]) -> list[nn.Parameter]:
    """The weights of `module`'s linear layers that run in FP8: every nn.Linear's, except
    inside a module of a type in `keep` (the embedding, the head, a router)."""
    kept = {id(m) for k in module.modules() if isinstance(k, keep) for m in k.modules()}
    return [m.weight for m in module.modules()
            if isinstance(m, nn.Linear) and id(m) not in kept]


class Fp8Stage(Stage):
    """A pipeline stage (the engine's extension point) whose blocks' linear layers run in
    emulated FP8; the embedding, the head and a router stay float32."""

    def __init__(self, module: nn.Module, index: int) -> None:
        from ..mesh.decoder_layers import DecoderEmbedding, DecoderHead
        from ..moe.routing import Gate

        super().__init__(module, index)
        self.fp8 = Fp8Matmuls(fp8_weights(module, (DecoderEmbedding, DecoderHead, Gate)))

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        with self.fp8:
            return self.module(x)
