"""The parameter server: sync equals single-process SGD; traffic as the cost model says;
async converges with bounded, recorded staleness."""

from collections import Counter

import pytest
import torch
from conftest import value_errors

import minipar
from minipar import collectives
from minipar.data_parallel import single_process_sgd
from minipar.data_parallel.parameter_server import train_parameter_server
from minipar.models import mlp, mse, regression_data

STEPS, BATCH, LR = 4, 12, 0.2


def _setup():
    model = mlp([6, 10, 1], seed=3, dtype=torch.float64)
    x, y = regression_data(STEPS * BATCH, 6, seed=4, dtype=torch.float64)
    return model, list(zip(x.split(BATCH), y.split(BATCH), strict=True))



def _single_process():
    model, batches = _setup()
    return single_process_sgd(model, batches, mse, LR)


def _run_sync(servers):
    model, batches = _setup()
    with collectives.meter() as m:
        report = train_parameter_server(model, batches, mse, LR, servers=servers)
    return report, m.sent_bytes, m.recv_bytes


@pytest.mark.parametrize("world_size, servers", [(2, 1), (4, 1), (4, 2)])
def test_sync_equals_single_process_sgd(world_size, servers):
    results = minipar.launch(_run_sync, world_size, servers, backend="gloo", timeout=60)
    ref_losses, ref_params = _single_process()
    server_slices = [r[0].params for r in results[:servers]]
    assert torch.allclose(torch.cat(server_slices), ref_params, rtol=1e-12, atol=1e-14)
    worker_losses = [r[0].losses for r in results[servers:]]
    step_losses = [sum(step) / len(worker_losses) for step in zip(*worker_losses, strict=True)]
    assert step_losses == pytest.approx(ref_losses, rel=1e-12)
    # the lecture's traffic, per step: worker up = gradient, down = model;
    # the servers together: up = W x model, down = W x gradient
    model_bytes = ref_params.numel() * 8
    workers = world_size - servers
    for _, sent, received in results[servers:]:
        assert (sent, received) == (STEPS * model_bytes, STEPS * model_bytes)
    assert sum(r[1] for r in results[:servers]) == STEPS * workers * model_bytes
    assert sum(r[2] for r in results[:servers]) == STEPS * workers * model_bytes


def _run_async(max_staleness, slow):
    model, _ = _setup()
    x, y = regression_data(20 * BATCH, 6, seed=4, dtype=torch.float64)
    batches = list(zip(x.split(BATCH), y.split(BATCH), strict=True))
    report = train_parameter_server(model, batches, mse, 0.1, mode="async",
                                    max_staleness=max_staleness, slow_workers=slow)
    return report


def test_async_converges_with_bounded_recorded_staleness():
    results = minipar.launch(_run_async, 4, 1, {3: 0.01}, backend="gloo", timeout=60)
    server = results[0]
    assert server.role == "server" and len(server.staleness) + server.dropped == 3 * 20
    assert max(server.staleness) <= 1
    assert server.dropped > 0  # the slow worker's gradients arrive 2+ versions late
    # every gradient is accounted to the worker that sent it: 20 from each, applied or dropped
    assert len(server.applied_from) == len(server.staleness)
    assert len(server.dropped_from) == server.dropped
    sent = Counter(server.applied_from) + Counter(server.dropped_from)
    assert sent == {1: 20, 2: 20, 3: 20}
    for worker in results[1:]:
        assert worker.losses[-1] < 0.5 * worker.losses[0]
    unbounded = minipar.launch(_run_async, 4, None, {3: 0.01}, backend="gloo", timeout=60)[0]
    assert unbounded.dropped == 0 and max(unbounded.staleness) >= 2


def test_bad_configurations_are_refused(cluster2):
    def attempt(kwargs):
        model, batches = _setup()
        return value_errors(lambda: train_parameter_server(model, batches, mse, LR, **kwargs))[0]

    for kwargs, words in [({"servers": 2}, "servers must be an int from 1 to world_size - 1"),
                          ({"mode": "gossip"}, "mode must be one of"),
                          ({"max_staleness": -1}, "max_staleness must be None or an int")]:
        assert words in cluster2.run(attempt, kwargs)[0]


def _worker_dies():
    model, batches = _setup()

    def exploding_loss(out, y):
        if minipar.rank() == 2 and len(exploding_loss.calls) == 2:
            raise RuntimeError("worker lost its data")
        exploding_loss.calls.append(1)
        return mse(out, y)

    exploding_loss.calls = []
    train_parameter_server(model, batches, exploding_loss, LR)


def test_a_worker_dying_mid_training_is_named_not_a_hang():
    with pytest.raises(minipar.RankError, match="rank 2 raised RuntimeError: worker lost its data"):
        minipar.launch(_worker_dies, 3, backend="gloo", timeout=30)


def test_more_servers_than_parameters_is_refused():
    def attempt():
        tiny = torch.nn.Linear(1, 1, bias=False)  # one parameter
        return value_errors(lambda: train_parameter_server(tiny, [], mse, LR, servers=2))[0]

    assert "the model has only 1 parameters; use at most 1 servers" in \
        minipar.launch(attempt, 3, backend="gloo", timeout=30)[0]
