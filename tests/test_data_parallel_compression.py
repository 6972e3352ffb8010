"""Compressors: lossless at full size, bounded error, error feedback delivers everything
eventually, bytes shrink, training still converges; the adaptive plan meets its budget."""

import math

import pytest
import torch

import minipar
from minipar import collectives
from minipar.data_parallel.compression import (
    Compressor,
    ErrorFeedback,
    Int8,
    PowerSGD,
    TopK,
    choose_levels,
    train_compressed,
)
from minipar.models import mlp, regression_data


def _averages():
    g = torch.Generator().manual_seed(minipar.rank())
    matrix = torch.randn(6, 5, generator=g, dtype=torch.float64)
    exact = collectives.all_reduce(matrix.clone(), op="avg")
    out = {"exact": exact}
    for name, comp in [("top1", TopK(1.0)), ("int8", Int8()), ("power5", PowerSGD(5)),
                       ("top0.2", TopK(0.2))]:
        with collectives.meter() as m:
            out[name] = comp.average(matrix, "w")
        out[name + "_bytes"] = m.sent_bytes
    return out


def test_compressed_averages(cluster2):
    for r in cluster2.run(_averages):
        assert torch.allclose(r["top1"], r["exact"], atol=1e-12)
        assert torch.allclose(r["power5"], r["exact"], atol=1e-10)  # full rank: exact
        scale = r["exact"].abs().max() * 2 / 127  # each rank's rounding is at most scale/2
        assert (r["int8"] - r["exact"]).abs().max() <= scale
        assert r["top0.2_bytes"] < 0.5 * r["top1_bytes"]


def test_error_feedback_delivers_the_whole_gradient_over_time():
    torch.manual_seed(0)
    g = torch.randn(50, dtype=torch.float64)
    feedback, comp = ErrorFeedback(), TopK(0.1)
    sent = torch.zeros_like(g)
    steps = 200
    for _ in range(steps):
        corrected = g + feedback.residuals.get("g", torch.zeros_like(g))
        feedback.residuals["g"] = corrected - comp.round_trip(corrected)
        sent += comp.round_trip(corrected)
    # what was sent = steps x g minus the final residual: the average converges to g
    assert torch.allclose(sent + feedback.residuals["g"], steps * g)
    assert (sent / steps - g).abs().max() < 0.05 * g.abs().max()


def test_choose_levels_meets_the_budget_with_fewest_bytes():
    errors = [[0.5, 0.1, 0.0], [0.3, 0.05, 0.0], [0.2, 0.2, 0.0]]
    sizes = [[1, 10, 100], [2, 20, 200], [1, 1, 50]]
    picks = choose_levels(errors, sizes, budget=0.62)
    assert sum(errors[i][p] for i, p in enumerate(picks)) <= 0.62
    assert picks == [1, 0, 0]  # 10 + 2 + 1 bytes, error 0.1 + 0.3 + 0.2
    with pytest.raises(ValueError, match="no choice of levels meets"):
        choose_levels([[0.5]], [[1]], budget=0.1)


@pytest.mark.parametrize("make, words", [(lambda: TopK(0), "ratio must be in \\(0, 1\\]"),
                                         (lambda: TopK(1.5), "ratio must be in"),
                                         (lambda: PowerSGD(0), "rank must be an int >= 1")])
def test_bad_settings(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def _train(method):
    model = mlp([8, 32, 32, 1], seed=0, dtype=torch.float64)
    x, y = regression_data(30 * 16, 8, seed=2, dtype=torch.float64)
    batches = list(zip(x.split(16), y.split(16), strict=True))
    comp = {"dense": TopK(1.0), "top-k": TopK(0.05), "int8": Int8(),
            "powersgd": PowerSGD(2), "adaptive": "adaptive"}[method]
    return train_compressed(model, batches, lambda o, t: ((o - t) ** 2).mean(), 0.2, comp)


def test_compressed_training_converges_with_fewer_bytes(cluster2):
    reports = {m: cluster2.run(_train, m)[0]
               for m in ("dense", "top-k", "int8", "powersgd", "adaptive")}
    dense = reports["dense"]
    for method, report in reports.items():
        assert sum(report.losses[-5:]) < 0.6 * sum(report.losses[:5]), method
        if method != "dense":
            assert sum(report.payload_bytes) < 0.6 * sum(dense.payload_bytes), method
    assert reports["adaptive"].levels and not math.isnan(reports["adaptive"].losses[-1])


def _feedback_ledger(compressor_name):
    """T steps of error-feedback averaging on this rank; returns the sum of applied updates,
    the ranks' mean final residual and the sum of the ranks' mean gradients."""
    import torch.distributed as dist

    comp = {"none": Compressor, "top-k": lambda: TopK(0.2), "int8": Int8,
            "powersgd": lambda: PowerSGD(1)}[compressor_name]()
    feedback, k = ErrorFeedback(), dist.get_world_size()
    applied, mean_gradients = torch.zeros(6, 5, dtype=torch.float64), 0
    for step in range(5):
        grads = [torch.randn(6, 5, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(100 * step + r))
                 for r in range(k)]
        applied += feedback.average(comp, grads[minipar.rank()], "w")
        mean_gradients = mean_gradients + sum(grads) / k
    residual = collectives.all_reduce(feedback.residuals["w"].clone(), op="avg")
    return applied, residual, mean_gradients


@pytest.mark.parametrize("name", ["none", "top-k", "int8", "powersgd"])
def test_error_feedback_loses_nothing_applied_plus_residual_is_the_mean_gradient(cluster2, name):
    for applied, residual, mean_gradients in cluster2.run(_feedback_ledger, name):
        assert torch.allclose(applied + residual, mean_gradients, rtol=1e-9, atol=1e-9), name
        assert not torch.allclose(applied, mean_gradients) or name == "none"
