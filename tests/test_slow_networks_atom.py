"""ATOM (slow_networks/atom.py): a peer swapping the whole model through a device smaller
than the model trains exactly as in memory; peers averaging every step are synchronous
SGD; only model averages cross the network (SWARM's traffic is its formula); the cost
model's crossover; bad input is one line."""

import math

import torch
from conftest import value_errors

import minipar
from minipar.cost import Link, all_reduce_cost
from minipar.data_parallel import single_process_sgd
from minipar.models import linear_stack, mlp, mse, regression_data
from minipar.pipeline.engine import split_model
from minipar.pipeline.swarm import swarm
from minipar.slow_networks.atom import (
    SwappedReplica,
    SwarmTraffic,
    atom_seconds,
    crossover,
    swarm_seconds,
    swarm_traffic,
    train_atom,
)

BATCH = 16


def _model():
    # 8 equal hidden layers: a swapped device holds about 3 of them (one computing, one
    # loading, its gradients), well under the whole model
    return mlp([8] + [96] * 8 + [1], seed=5, dtype=torch.float64)


def _batches(steps):
    x, y = regression_data(steps * BATCH, 8, seed=6, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_swapped_training_equals_in_memory_exactly_under_a_budget_the_model_exceeds():
    reference = _model()
    opt = _adam(reference.parameters())
    for x, y in _batches(4):
        opt.zero_grad()
        mse(reference(x), y).backward()
        opt.step()
    budget = _param_bytes(_model()) * 3 // 4  # the parameters alone do not fit
    replica = SwappedReplica(_model(), _adam, mse, budget=budget)
    for step, (x, y) in enumerate(_batches(4)):
        replica.local_step(x, y, step)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.equal(replica.vector(), expected)
    assert replica.peak() <= budget < _param_bytes(_model())


def test_averaging_every_step_is_synchronous_sgd_with_and_without_swapping(cluster2):
    _, reference = single_process_sgd(_model(), _batches(5), mse, 0.1)
    for swap in (False, True):
        results = cluster2.run(train_atom, _model, _batches(5), mse, 0.1, local_steps=1,
                               method="local_sgd", swap=swap)
        for report, params in results:
            assert report.rounds == 5
            assert torch.allclose(params, reference, rtol=1e-12, atol=1e-14)


def test_only_model_averages_cross_the_network_and_co2_peers_converge(cluster2):
    results = cluster2.run(train_atom, _model, _batches(24), mse, 0.1, local_steps=4,
                           method="co2", budget=_param_bytes(_model()) * 3 // 4)
    ring = all_reduce_cost("ring", 2, _param_bytes(_model())).busiest_rank_bytes
    model, data = _model(), _batches(24)
    before = sum(mse(model(x), y).item() for x, y in data)
    for report, params in results:
        assert report.rounds == 6
        assert report.sent_bytes == report.rounds * ring  # no activation, no gradient
        torch.nn.utils.vector_to_parameters(params, model.parameters())
        assert sum(mse(model(x), y).item() for x, y in data) < 0.7 * before


def _swarm_bytes(steps):
    with minipar.collectives.meter() as m:
        swarm(lambda: linear_stack(8, 4, seed=1, dtype=torch.float64), [[1], [2]],
              [(torch.ones(8, 8, dtype=torch.float64), torch.zeros(8, 8, dtype=torch.float64))]
              * steps, mse, 0.1, 4)
    return m.sent_bytes


def test_swarm_sends_what_its_traffic_formula_says():
    sent = minipar.launch(_swarm_bytes, 3, 2, backend="gloo", timeout=60)
    stages = split_model(linear_stack(8, 4, seed=1, dtype=torch.float64), 2)
    formula = swarm_traffic([8 * 8 * 8] * 3, [_param_bytes(s) for s in stages], 4, 8)
    # plus, once per run, the header that stops each of the 2 workers
    assert sum(sent) == 2 * formula.nbytes + 2 * 32


def test_the_cost_model_crosses_where_the_two_steps_are_equal():
    # ATOM: a long base step, one average of 1 MB every 4 steps; SWARM: short, 10 MB a step
    def atom(link):
        return atom_seconds(0.05, 10**6, 2, 4, link)

    def pipeline(link):
        return swarm_seconds(0.01, SwarmTraffic(10, 10**7), link)

    found = crossover(atom, pipeline, 1e-3)
    where = found.bandwidth
    assert found.atom_ahead_below and 1e8 < where < 1e10
    assert math.isclose(atom(Link(1e-3, where)), pipeline(Link(1e-3, where)), rel_tol=1e-6)
    assert atom(Link(1e-3, where / 2)) < pipeline(Link(1e-3, where / 2))
    # an average CO2 can hide behind 4 long steps costs nothing; one it cannot, its excess
    assert atom_seconds(1.0, 10**6, 2, 4, Link(0, 1e6)) == 1.0
    assert math.isclose(atom_seconds(0.1, 10**6, 2, 4, Link(0, 1e6)), 0.1 + 0.6 / 4)


def test_bad_input_is_one_line(cluster2):
    def bad():
        return value_errors(
            lambda: train_atom(_model, _batches(2), mse, 0.1, method="gossip"),
            lambda: train_atom(_model, _batches(2), mse, 0.1, budget=1000),
            lambda: train_atom(_model, _batches(2), mse, 0.1, local_steps=0))

    method, budget, steps = cluster2.run(bad)[0]
    assert method == "method must be one of ('co2', 'local_sgd'); got 'gossip'"
    assert "cannot hold one layer" in budget and "\n" not in budget
    assert "local_steps must be an int >= 1" in steps
