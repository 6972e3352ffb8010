"""The lesson-00 calculators reproduce the curriculum's figures from their inputs."""

import math

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


def test_activation_formula_splits_over_tp_as_korthikanti_eq_2():
    s, h, a, t = 2048, 12288, 96, 8  # GPT-3 175B's layer on a tensor-parallel group of 8
    per = s * h
    assert cost.activation_bytes(1, h, s, 1, a, "none", tp=t) == per * (10 + 24 / t
                                                                         + 5 * a * s / (h * t))
    assert cost.activation_bytes(1, h, s, 1, a, "none", tp=t, sequence_parallel=True) == \
        pytest.approx(per * (34 + 5 * a * s / h) / t)
    assert cost.activation_bytes(1, h, s, 1, a, "selective", tp=t) == per * (10 + 24 / t)
    assert cost.activation_bytes(1, h, s, 1, a, "selective", tp=t, sequence_parallel=True) \
        == pytest.approx(per * 34 / t)
    assert cost.activation_bytes(1, h, s, 1, a, "full", tp=t) == per * 2
    assert cost.activation_bytes(1, h, s, 1, a, "full", tp=t, sequence_parallel=True) == \
        per * 2 / t
    # tp = 1: sequence parallelism over one rank changes nothing
    assert cost.activation_bytes(1, h, s, 1, a, "none", sequence_parallel=True) == \
        cost.activation_bytes(1, h, s, 1, a, "none")


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
    (lambda: cost.activation_bytes(1, 8, 8, 1, 1, tp=0), "tp must be > 0"),
    (lambda: cost.transformer_shape(0), "params must be > 0"),
])
def test_bad_input_names_the_parameter(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_transformer_shape_recovers_published_models():
    assert cost.transformer_shape(175e9) == (96, 12288, 96)  # GPT-3
    layers, hidden, heads = cost.transformer_shape(7e9)
    assert (layers, hidden, heads) == (33, 4224, 33)  # LLaMA-7B has 32 layers of 4096
    assert 12 * hidden**2 * layers == pytest.approx(7e9, rel=0.05)


def test_resnet50_parameter_server_adds_about_50_percent():
    grad_bytes = 25.6e6 * 4  # ResNet-50's parameters in fp32: ~0.1 GB of gradients
    compute = 32 * 3 * 4.1e9 / 1.2e12  # batch 32, ~3x the 4.1 GFLOP forward, 1.2 TFLOP/s
    # the slide's figure: pushes and pulls share the server's link one after the other
    comm = cost.parameter_server_seconds(256, grad_bytes, grad_bytes, 300e9, full_duplex=False)
    assert compute == pytest.approx(0.33, rel=0.01)
    assert comm == pytest.approx(0.16, rel=0.1)
    assert comm / compute == pytest.approx(0.5, rel=0.1)
    # a link that carries both directions at once, as every all-reduce is priced: half
    assert cost.parameter_server_seconds(256, grad_bytes, grad_bytes, 300e9) == comm / 2
    t = cost.parameter_server_traffic(4, model_bytes=10, grad_bytes=7)
    assert (t.worker_up, t.worker_down, t.server_up, t.server_down) == (7, 10, 40, 28)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 8])
def test_all_reduce_cost_shapes(k):
    n = 1e6
    ring = cost.all_reduce_cost("ring", k, n, alpha=1e-5, beta=1e-9)
    assert ring.steps == 2 * (k - 1)
    assert ring.busiest_rank_bytes == pytest.approx(2 * (k - 1) / k * n)
    assert ring.seconds == pytest.approx(2 * (k - 1) * (1e-5 + n / k * 1e-9))
    naive = cost.all_reduce_cost("naive", k, n)
    assert naive.busiest_rank_bytes == (k - 1) * n
    tree = cost.all_reduce_cost("tree", k, n)
    assert tree.steps == 2 * math.ceil(math.log2(k))
    hd = cost.all_reduce_cost("halving_doubling", k, n)
    assert hd.steps == 2 * math.ceil(math.log2(k))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        cost.all_reduce_cost("star", k, n)


def test_fit_alpha_beta_recovers_a_line():
    sizes = [0, 1e3, 1e4, 1e5, 1e6]
    alpha, beta = cost.fit_alpha_beta(sizes, [2e-5 + 3e-10 * s for s in sizes])
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(3e-10)


def test_transformer_flop_shares_follow_the_lecture_trend():
    small, large = cost.flop_shares(cost.OPT_CONFIGS["760M"]), \
        cost.flop_shares(cost.OPT_CONFIGS["175B"])
    assert sum(small.values()) == pytest.approx(1.0)
    assert large["ffn"] > small["ffn"]  # FFN dominates more as models grow
    assert small["attention scores"] == pytest.approx(0.166, abs=0.01)  # lecture: ~15%
    assert large["attention scores"] == pytest.approx(0.027, abs=0.005)  # lecture: ~3%
    assert small["logits"] == pytest.approx(0.085, abs=0.01)  # lecture: ~6%
    assert large["logits"] == pytest.approx(0.0035, abs=0.001)  # lecture: ~0.3%
    # with ffn = 4h the FFN always does twice the projections' work
    assert large["ffn"] / large["attention projections"] == pytest.approx(2.0)
    assert cost.OPT_CONFIGS["175B"].params / 1e9 == pytest.approx(175, rel=0.02)


def test_tensor_parallel_bytes():
    cfg = cost.TransformerConfig(layers=1, hidden=1024, heads=16, seq_len=512)
    assert cost.tensor_parallel_bytes(cfg, batch=4, tp=1) == 0
    assert cost.tensor_parallel_bytes(cfg, batch=4, tp=2) == 4 * 512 * 4 * 1024 * 2
