"""Emulated FP8 (train/fp8.py): the formats' rounding, the linear layer's forward and
backward, which matmuls the trainer runs in it, and `minipar train compare` holding an
fp8 run to the spread of training instead of to rounding."""

from dataclasses import replace

import pytest
import torch
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

import minipar
from minipar.train.compare import compare, report
from minipar.train.fp8 import E4M3, E5M2, Fp8Linear, quantize
from minipar.train.loop import build_part, refuse_unbuilt, train


@pytest.mark.parametrize("dtype, mantissa", [(E4M3, 3), (E5M2, 2)])
def test_quantize_scales_the_largest_value_onto_the_formats_and_rounds_to_it(dtype, mantissa):
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64) * 1e-3  # far below the format's range
    q = quantize(x, dtype)
    fmax = torch.finfo(dtype).max
    # the largest lands on fmax and comes back (up to the float32 scale's rounding)
    assert q.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    scaled = x * fmax / x.abs().max()
    normal = scaled.abs() >= torch.finfo(dtype).tiny  # subnormals round coarser
    # round to nearest with `mantissa` bits: at most half a unit in the last place
    error = ((q - x).abs() / x.abs())[normal]
    assert error.max() <= 2.0 ** -(mantissa + 1) * (1 + 1e-6)
    assert error.max() > 2.0 ** -(mantissa + 3)  # it really rounded: no float32 pass-through
    assert torch.equal(quantize(q, dtype), q)  # a representable tensor stays as it is
    zeros = torch.zeros(3)
    assert torch.equal(quantize(zeros, dtype), zeros)


def test_fp8_linear_multiplies_the_quantized_inputs_and_quantizes_the_gradient():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    y = Fp8Linear.apply(x, w, b)
    xq, wq = quantize(x.detach()), quantize(w.detach())
    assert torch.equal(y, torch.nn.functional.linear(xq, wq, b.detach()))
    g = torch.randn_like(y)
    y.backward(g)
    gq = quantize(g, E5M2)
    assert torch.allclose(x.grad, gq @ wq, rtol=1e-6, atol=1e-6)
    assert torch.allclose(w.grad, gq.reshape(-1, 8).t() @ xq.reshape(-1, 16), rtol=1e-5,
                          atol=1e-5)
    assert torch.allclose(b.grad, g.sum((0, 1)))
    # against float32: close, but not float32's own result
    exact = torch.nn.functional.linear(x.detach(), w.detach(), b.detach())
    relative = (y - exact).norm() / exact.norm()
    assert 1e-3 < relative < 0.1


def _fp8_names(config):
    part = build_part(config)
    names = {id(p): n for n, p in part.model.named_parameters()}
    return sorted(names[i] for stage in part.model.pipe.stages.values()
                  for i in stage.fp8.weights)


@pytest.mark.slow  # an FP8 trainer run
def test_the_blocks_linear_layers_run_in_fp8_the_ends_and_the_router_do_not(corpus):  # noqa: F811
    base = tiny(corpus)
    config = replace(base, train=replace(base.train, precision="fp8"))
    names = minipar.launch(_fp8_names, 1, config)[0]
    assert names and all(".attn." in n or ".mlp." in n for n in names), names
    per_block = {n.split(".", 2)[2] for n in names}
    assert len(names) == config.model.layers * len(per_block) >= 2 * 7
    moe = replace(config, model=replace(config.model, experts=4))
    routed = minipar.launch(_fp8_names, 1, moe)[0]
    assert routed and not any("router" in n or "gate" in n for n in routed)
    recompute = replace(config, train=replace(config.train, recompute="full"))
    with pytest.raises(ValueError, match="recomputed forward would run its matmuls in float32"):
        refuse_unbuilt(recompute)


@pytest.mark.slow  # trainer runs for the spread of training
def test_compare_holds_another_precision_to_the_spread_of_training(corpus):  # noqa: F811
    """fp8 against an fp32 reference cannot match to rounding; it is held to the gap
    between two seeds, and lands inside it on the tiny decoder."""
    base = tiny(corpus)
    base = replace(base, train=replace(base.train, precision="fp32"))
    fp8 = replace(base, train=replace(base.train, precision="fp8"))
    result = compare(base, [("train.precision=fp8", fp8)],
                     lambda c: minipar.launch(train, 1, c, None, True)[0])
    row = result["rows"][1]
    assert row["other_precision"] and 0 < row["largest_gap"] <= result["seed_spread"]
    assert row["largest_gap"] > 10 * result["tolerance"]  # far outside rounding's bound
    assert row["matches"]
    assert "within the seeds' spread" in report(result) and "within their bounds" in report(result)
