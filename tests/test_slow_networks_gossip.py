"""Decentralized averaging: SGP and grouped all-reduce equal synchronous SGD where their
graph is complete, reach the exact average after log2(K) pure-gossip steps, and train
the regression with stated tolerances, sending less than an all-reduce."""

import pytest
import torch
import torch.distributed as dist

from minipar import collectives
from minipar.data_parallel import single_process_sgd
from minipar.models import mlp, mse, regression_data
from minipar.runtime import rank
from minipar.slow_networks.gossip import butterfly_groups, out_peers, push_sum, train_gossip

BATCH = 16


def _model64():
    return mlp([4, 8, 1], seed=5, dtype=torch.float64)


def _batches(steps):
    x, y = regression_data(steps * BATCH, 4, seed=6, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


@pytest.mark.parametrize("method,options", [("sgp", {"graph": "complete"}),
                                            ("grouped", {"group_size": 4})])
def test_complete_graphs_are_synchronous_sgd(method, options, cluster4):
    results = cluster4.run(train_gossip, method, _model64, _batches(5), mse, 0.2, **options)
    _, reference = single_process_sgd(_model64(), _batches(5), mse, 0.2)
    for report, params in results:
        assert torch.allclose(params, reference, rtol=1e-12, atol=1e-14)
        assert max(report.consensus) < 1e-20  # every rank holds the same model


def _pure_gossip(kind):
    """Different values on every rank, no gradients: log2(4) = 2 steps of mixing."""
    x = torch.tensor([10.0 * rank(), 1.0 + rank()], dtype=torch.float64)
    if kind == "sgp":
        w = 1.0
        for step in range(2):
            peers = out_peers(rank(), 4, step)
            sources = [r for r in range(4) if rank() in out_peers(r, 4, step)]
            x, w = push_sum(x, w, peers, sources)
        return x / w
    for partition in butterfly_groups(4, 2):
        groups = [dist.new_group(members) for members in partition]
        mine = next(g for g, m in zip(groups, partition, strict=True) if rank() in m)
        x = collectives.all_reduce(x, op="avg", group=mine)
    return x


@pytest.mark.parametrize("kind", ["sgp", "grouped"])
def test_log2_k_steps_of_gossip_reach_the_exact_average(kind, cluster4):
    for z in cluster4.run(_pure_gossip, kind):
        assert torch.allclose(z, torch.tensor([15.0, 2.5], dtype=torch.float64))


@pytest.mark.parametrize("method,options", [("sgp", {}),
                                            ("grouped", {"group_size": 2, "swap_every": 2})])
def test_gossip_trains_and_sends_less_than_an_all_reduce(method, options, cluster4):
    results = cluster4.run(train_gossip, method, _model64, _batches(60), mse, 0.2, **options)
    sync_losses, _ = single_process_sgd(_model64(), _batches(60), mse, 0.2)
    params = torch.stack([p for _, p in results])
    for report, _ in results:
        # stated tolerance: the last 10 steps' mean loss within 50% of synchronous SGD's
        late = sum(report.losses[-10:]) / 10
        assert late < 1.5 * sum(sync_losses[-10:]) / 10 + 1e-3, (late, sync_losses[-10:])
        assert late < 0.2 * report.losses[0]
        # the ranks stay close: consensus distance small next to the parameters' size
        assert report.consensus[-1] < 1e-2 * float(params[0].pow(2).sum())
        numel = params.shape[1]
        ring = 2 * 3 / 4 * numel * 8  # what a ring all-reduce of the parameters sends
        assert max(report.sent_bytes) < ring


def test_graphs_and_groups_refuse_bad_shapes():
    assert out_peers(0, 8, 0) == [1] and out_peers(0, 8, 1) == [2] and out_peers(0, 8, 3) == [1]
    assert out_peers(2, 3, 0, "complete") == [0, 1]
    assert butterfly_groups(4, 2) == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    with pytest.raises(ValueError, match="graph must be one of"):
        out_peers(0, 4, 0, "ring")
    with pytest.raises(ValueError, match="world size a power of it"):
        butterfly_groups(6, 4)
    with pytest.raises(ValueError, match="method must be one of"):
        train_gossip("gossip", _model64, [], mse, 0.1)
