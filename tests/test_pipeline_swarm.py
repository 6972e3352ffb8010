"""SWARM: pools of workers per stage, throughput-weighted routing; a worker killed
mid-run loses only its micro-batches, which go through again, so training equals one
process even across the death."""

import random

import pytest
import torch

import minipar
from minipar.data_parallel import single_process_sgd
from minipar.models import mlp, mse, regression_data
from minipar.pipeline.engine import split_model
from minipar.pipeline.swarm import SwarmReport, pick, swarm

POOLS = [[1, 2], [3, 4]]
STEPS, BATCH, MICRO, LR = 4, 32, 8, 0.1


def _model():
    return mlp([6, 16, 16, 1], seed=3, dtype=torch.float64)


def _batches():
    x, y = regression_data(STEPS * BATCH, 6, seed=4, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _reference():
    """One process on the whole batches: the micro-batch losses' mean is the batch's."""
    model = _model()
    single_process_sgd(model, _batches(), mse, LR)
    return [torch.nn.utils.parameters_to_vector(m.parameters()).detach()
            for m in split_model(model, 2)]


# kill_at_step: a death by step, which no routing can dodge (a slowed victim gets few
# forwards, so a death at its n-th forward might never come)
@pytest.mark.parametrize("kill, slowdown", [(None, None), ({2: 1}, None), ({3: 2}, None),
                                            ({3: 1}, {3: 10.0})])
@pytest.mark.slow  # a swarm run, a worker killed or slowed
def test_swarm_equals_one_process_even_when_a_worker_dies(kill, slowdown):
    results = minipar.launch(swarm, 5, _model, POOLS, _batches(), mse, LR, MICRO,
                             slowdown=slowdown, kill_at_step=kill, backend="gloo", timeout=60,
                             tolerate_deaths=True)
    report = results[0]
    assert isinstance(report, SwarmReport) and len(report.losses) == STEPS
    want = _reference()
    for stage, pool in enumerate(POOLS):
        for w in pool:
            if kill and w in kill:
                assert isinstance(results[w], minipar.RankDied)
                continue
            assert torch.allclose(results[w], want[stage], rtol=1e-10, atol=1e-12), (w, kill)
    if kill:
        ((victim, step),) = kill.items()
        # noticed in the very step it died, at the first request sent to it; whether it
        # held micro-batches to send again (report.resent) depends on the routing
        assert report.deaths == [(step, victim)]
        # after its death the victim serves nothing; its pool-mate serves every micro-batch
        later = report.served[step + 1:]
        assert all(victim not in s for s in later)
        mate = next(w for pool in POOLS if victim in pool for w in pool if w != victim)
        assert all(s[mate] == MICRO for s in later)
    else:
        assert report.deaths == [] and report.resent == 0
        assert all(sum(s.get(w, 0) for w in pool) == MICRO for s in report.served
                   for pool in POOLS)


def test_routing_is_proportional_to_throughput():
    rng = random.Random(0)
    picks = [pick({1: 3.0, 2: 1.0}, rng) for _ in range(4000)]
    assert 0.7 < picks.count(1) / len(picks) < 0.8


def test_pools_must_not_hold_the_trainer():
    with pytest.raises(ValueError, match="without rank 0"):
        swarm(_model, [[0, 1], [2]], _batches(), mse, LR, MICRO)
