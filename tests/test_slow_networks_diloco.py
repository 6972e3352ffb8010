"""DiLoCo (slow_networks/diloco.py): local SGD is its outer SGD of rate 1; with inner SGD
(momentum and weight decay too), H = 1 and that outer step it is synchronous data
parallelism, in float64; with inner AdamW it is not, and that is the point of the
method, not a bug."""

import pytest
import torch
from torch.nn.utils import parameters_to_vector

import minipar
from minipar.data_parallel import task
from minipar.models import mse
from minipar.slow_networks.diloco import OptimizerReplica, diloco, outer_optimizer
from minipar.slow_networks.relaxed import SGDReplica, local_sgd

STEPS = 6


def _params(model) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def _local_sgd_both_ways(h: int) -> tuple[torch.Tensor, torch.Tensor]:
    plain, outer = task.model(), task.model()
    local_sgd(SGDReplica(plain, mse, task.LR), task.batches(STEPS), h)
    diloco(SGDReplica(outer, mse, task.LR), task.batches(STEPS), h, outer_lr=1.0,
           outer_momentum=0.0)
    return _params(plain), _params(outer)


def test_local_sgd_is_diloco_with_an_outer_sgd_of_rate_1(cluster2):
    for plain, outer in cluster2.run(_local_sgd_both_ways, 3):
        assert torch.allclose(plain, outer, rtol=1e-12, atol=1e-14)


def _inner(kind: str):
    def make(params):
        if kind == "sgd":
            return torch.optim.SGD(params, lr=task.LR, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return make


def _diloco_h1(kind: str) -> torch.Tensor:
    model = task.model()
    diloco(OptimizerReplica(model, mse, _inner(kind)(model.parameters())),
           task.batches(STEPS), 1, outer_lr=1.0, outer_momentum=0.0)
    return _params(model)


def _synchronous(kind: str) -> torch.Tensor:
    """One process, whole batches: what synchronous data parallelism computes."""
    model = task.model()
    opt = _inner(kind)(model.parameters())
    for x, y in task.batches(STEPS):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    return _params(model)


def test_inner_sgd_with_momentum_h1_and_outer_rate_1_is_synchronous_training(cluster2):
    reference = _synchronous("sgd")
    for params in cluster2.run(_diloco_h1, "sgd"):
        assert torch.allclose(params, reference, rtol=1e-10, atol=1e-13)


def test_inner_adamw_is_not_synchronous_training_even_at_h1(cluster2):
    """Each worker's Adam normalizes its own gradient: the average of two normalized
    steps is not the normalized step of the average gradient."""
    reference = _synchronous("adamw")
    alone = minipar.launch(_diloco_h1, 1, "adamw")[0]
    assert torch.allclose(alone, reference, rtol=1e-12, atol=1e-14)  # one worker: AdamW itself
    gap = max((p - reference).abs().max().item() for p in cluster2.run(_diloco_h1, "adamw"))
    assert gap > 1e-5, gap


def test_the_outer_optimizer_is_nesterov_with_momentum_and_refuses_bad_settings():
    _, opt = outer_optimizer(torch.zeros(3, dtype=torch.float64))
    assert opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.9
    assert opt.defaults["lr"] == 0.7
    with pytest.raises(ValueError, match="lr > 0 and 0 <= momentum < 1"):
        outer_optimizer(torch.zeros(3), lr=0.0)
    with pytest.raises(ValueError, match="local_steps must be an int >= 1"):
        diloco(None, [], 0)


@pytest.mark.slow  # runs the DiLoCo bench
def test_the_bench_meters_one_model_sized_message_per_round_against_ddps_per_step(tmp_path):
    from minipar.slow_networks import diloco_bench as bench

    rows = bench.measure(runs=((16, 0.7, 0.9),))
    ddp, h16 = rows
    assert ddp["method"] == "DDP" and ddp["vs_ddp"] == 1.0 and ddp["steps"] is not None
    # the same model-sized vector per message, one per step against one per 16 steps
    assert h16["total_bytes"] * 16 == ddp["total_bytes"]
    assert h16["target"] == ddp["target"] and len(h16["curve"]) == bench.STEPS // 16
    table = bench.report(rows, tmp_path)
    assert "bytes each rank sent to reach the held-out loss" in table
    assert (tmp_path / "bench_diloco.json").exists() and (tmp_path / "bench_diloco.png").exists()
