"""The lesson-00 calculators reproduce the curriculum's figures from their inputs."""

import pytest

from minipar import cost


def test_frontier_model_takes_about_282_years_on_one_device():
    seconds = cost.training_time(2e25, devices=1, flops_per_device=2.25e15)
    assert seconds / cost.SECONDS_PER_YEAR == pytest.approx(282, rel=0.005)
    # Perfect scaling: 10,000 devices at 40% utilization.
    many = cost.training_time(2e25, devices=10_000, utilization=0.4)
    assert many == pytest.approx(seconds / 4_000)


def test_training_flops_is_six_per_parameter_per_token():
    assert cost.training_flops(1e9, 1e12) == 6e21


def llama65b_finetune() -> cost.MemoryBreakdown:
    acts = cost.activation_bytes(layers=80, hidden=8192, seq_len=1024, batch=3, heads=64)
    return cost.training_memory(65e9, weights="bf16", grads="bf16", optimizer="adam",
                                optimizer_dtype="int8", activations=acts)


def test_65b_finetune_needs_about_457_gb():
    mem = llama65b_finetune()
    assert mem.weights == mem.gradients == mem.optimizer == 130e9
    assert mem.activations == pytest.approx(68.4e9, rel=0.001)
    assert mem.total / cost.GB == pytest.approx(457, rel=0.005)


def test_only_about_27b_fits_in_192_gb():
    fits = cost.largest_model(192e9, llama65b_finetune().bytes_per_param)
    assert fits / 1e9 == pytest.approx(27, rel=0.01)


def test_activation_formula_by_recompute_policy():
    full = cost.activation_bytes(1, 1024, 512, 1, 16, recompute="full")
    sel = cost.activation_bytes(1, 1024, 512, 1, 16, recompute="selective")
    none = cost.activation_bytes(1, 1024, 512, 1, 16, recompute="none")
    assert (full, sel) == (2 * 512 * 1024, 34 * 512 * 1024)
    assert none == 512 * 1024 * (34 + 5 * 16 * 512 / 1024)


def test_mixed_precision_adam_is_16_bytes_per_param():
    mem = cost.training_memory(1e9, weights="bf16", grads="bf16", optimizer="adam",
                               optimizer_dtype="fp32", master_weights="fp32")
    assert mem.bytes_per_param == 16


@pytest.mark.parametrize("call, words", [
    (lambda: cost.training_memory(1e9, weights="float16"), "weights must be one of"),
    (lambda: cost.training_memory(1e9, optimizer="lion"), "optimizer must be one of"),
    (lambda: cost.training_memory(-1), "params must be > 0"),
    (lambda: cost.training_time(1e20, utilization=1.5), r"utilization must be in \(0, 1\]"),
    (lambda: cost.activation_bytes(1, 8, 8, 1, 1, recompute="some"), "recompute must be one of"),
])
def test_bad_input_names_the_parameter(call, words):
    with pytest.raises(ValueError, match=words):
        call()
