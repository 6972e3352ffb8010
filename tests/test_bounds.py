"""The closed forms of `minipar.bounds`, against their derivations and against the meter."""

import math

import pytest
import torch

import minipar
from minipar import bounds, collectives, cost
from minipar.context_parallel import positions, ring_attention, ulysses_attention
from minipar.data_parallel import shard
from minipar.models import mlp
from minipar.sharded import FullyShardedDataParallel, ZeroDataParallel

LINK = cost.Link(latency=10e-6, bandwidth=50e9)


@pytest.mark.parametrize("k", [2, 4, 8, 6])
def test_half_bandwidth_sizes_match_their_closed_forms(k):
    ring = bounds.half_bandwidth_bytes("ring", k, LINK)
    tree = bounds.half_bandwidth_bytes("tree", k, LINK)
    assert ring == pytest.approx(k * LINK.alpha / LINK.beta)
    assert tree == pytest.approx(LINK.alpha / LINK.beta)
    # at n_1/2 the latency part is exactly half the time
    at = cost.all_reduce_cost("ring", k, ring, alpha=LINK.alpha, beta=LINK.beta)
    assert at.steps * LINK.alpha == pytest.approx(at.seconds / 2)


def test_the_ring_overtakes_the_tree_before_its_own_half_bandwidth_size():
    k = 8
    n = bounds.crossover_bytes("ring", "tree", k, LINK)
    times = [cost.all_reduce_cost(a, k, n, alpha=LINK.alpha, beta=LINK.beta).seconds
             for a in ("ring", "tree")]
    assert times[0] == pytest.approx(times[1])
    # closed form: (K-1 - log2 K) alpha / ((log2 K - (K-1)/K) beta)
    assert n == pytest.approx((k - 1 - 3) * LINK.alpha / ((3 - (k - 1) / k) * LINK.beta))
    assert n < bounds.half_bandwidth_bytes("ring", k, LINK)


def test_data_parallel_balance_crosses_one_at_the_critical_batch():
    params, k, flops = 7e9, 64, 400e12
    critical = bounds.critical_tokens_per_rank(params, k, LINK, flops)
    assert bounds.data_parallel_balance(params, critical, k, LINK, flops).ratio == \
        pytest.approx(1.0)
    # large models: (2(K-1)/K) * 2 bytes * F / (6 B), the latency terms negligible
    assert critical == pytest.approx(2 * (k - 1) / k * 2 * flops / (6 * LINK.bandwidth),
                                     rel=1e-2)
    zero3 = bounds.critical_tokens_per_rank(params, k, LINK, flops, stage=3)
    assert zero3 == pytest.approx(1.5 * critical)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="stage must be one of"):
        bounds.sync_bytes_per_rank(4, 8, 1.0)
    with pytest.raises(ValueError, match="method must be one of"):
        bounds.context_parallel_bytes("tree", 4, 1.0, 1.0)
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        bounds.half_bandwidth_bytes("ring", 1, LINK)
    with pytest.raises(ValueError, match="tokens_per_rank must be > 0"):
        bounds.data_parallel_balance(1e9, 0, 8, LINK, 1e12)


def _zero_sent(stage):
    model = mlp([4, 8, 8, 4], seed=0, dtype=torch.float64)
    adam = lambda ps: torch.optim.Adam(ps, lr=0.1)  # noqa: E731
    wrapped = FullyShardedDataParallel(model, adam) if stage == 3 else \
        ZeroDataParallel(model, adam, stage=stage)
    x = shard(torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    with collectives.meter() as m:
        wrapped(x).pow(2).mean().backward()
        wrapped.step()
    return m.sent_bytes


def test_zero_bytes_match_the_meter(cluster2):
    # 4*8+8 + 8*8+8 + 8*4+4 = 148 parameters: even on 2 ranks, and per layer too
    param_bytes = 148 * 8
    for stage in (1, 3):
        sent = cluster2.run(_zero_sent, stage)
        assert sent == [bounds.sync_bytes_per_rank(stage, 2, param_bytes)] * 2


def _attention_sent(method):
    k, me = minipar.world_size(), minipar.rank()
    gen = torch.Generator().manual_seed(2)
    q, kk, v = (torch.randn(1, 4, 32, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    pos = positions(me, k, 32, False)
    mine = [t[..., pos, :].clone().requires_grad_() for t in (q, kk, v)]
    with collectives.meter() as m:
        fn = ring_attention if method == "ring" else ulysses_attention
        fn(*mine, causal=True).sum().backward()
    return m.sent_bytes


@pytest.mark.parametrize("method", bounds.CONTEXT_METHODS)
def test_context_parallel_bytes_match_the_meter(cluster4, method):
    whole = 1 * 4 * 32 * 8 * 8  # q, k or v of the whole sequence, float64
    sent = cluster4.run(_attention_sent, method)
    assert max(sent) == bounds.context_parallel_bytes(method, 4, whole, whole)
    assert not math.isclose(bounds.context_parallel_bytes("ring", 16, whole, whole),
                            bounds.context_parallel_bytes("ulysses", 16, whole, whole))
