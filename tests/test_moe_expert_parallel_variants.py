"""Expert parallelism of the other routings: expert choice equals the one-process
ExpertChoiceMoE on the whole batch; LSH-MoE compresses each rank's own dispatch."""

import pytest
import torch
from conftest import grad_mismatches

import minipar
from minipar import collectives
from minipar.moe import ExpertChoiceMoE, ExpertParallelMoE, LSHMoE, MoELayer

TOKENS_PER_RANK, HIDDEN = 6, 8


def _tokens(world, seed=7):
    return torch.randn(world * TOKENS_PER_RANK, HIDDEN, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def _mine(x):
    me = minipar.rank()
    return x[me * TOKENS_PER_RANK:(me + 1) * TOKENS_PER_RANK]


def _grads(layer, twin, first):
    """Names whose gradient differs from the twin's (experts renumbered; the gate's and
    shared expert's summed over ranks first)."""
    for p in [*layer.gate.parameters(), *layer.shared.parameters()]:
        collectives.all_reduce(p.grad)
    return grad_mismatches(layer, twin, first)


def _expert_choice():
    size = minipar.world_size()
    make = lambda: ExpertChoiceMoE(HIDDEN, 16, 4, k=2, capacity_factor=0.5,  # noqa: E731
                                   shared_expert=True, seed=3, dtype=torch.float64)
    twin, layer = make(), ExpertParallelMoE(make())
    x_all = _tokens(size)
    ref_x = x_all.clone().requires_grad_()
    ref = twin(ref_x)
    ref.pow(2).sum().backward()
    x = _mine(x_all).clone().requires_grad_()
    with collectives.meter() as m:
        y = layer(x)
        y.pow(2).sum().backward()
    rows = slice(minipar.rank() * TOKENS_PER_RANK, (minipar.rank() + 1) * TOKENS_PER_RANK)
    return {"output": torch.allclose(y, ref[rows], rtol=1e-10, atol=1e-12),
            "input_grad": torch.allclose(x.grad, ref_x.grad[rows], rtol=1e-10, atol=1e-12),
            "wrong": _grads(layer, twin, minipar.rank() * layer.per_rank),
            "received": layer.tokens_received, "picks": twin.last_picks.shape,
            "skipped": int((twin.experts_per_token() == 0).sum()), "a2a": m.calls["all_to_all"]}


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_choice_expert_parallel_equals_one_process(ranks, cluster2, cluster4):
    results = (cluster2 if ranks == 2 else cluster4).run(_expert_choice)
    for r in results:
        assert r["output"] and r["input_grad"] and r["wrong"] == [], r
    experts, capacity = results[0]["picks"]
    assert sum(r["received"] for r in results) == experts * capacity  # balanced by design
    assert len({r["received"] for r in results}) == 1  # every rank's experts: C each
    assert results[0]["skipped"] > 0  # some tokens no expert picked, in both


def _lsh(bits, noise, capacity_factor=2.0):
    size = minipar.world_size()
    layer = ExpertParallelMoE(LSHMoE(HIDDEN, 16, 4, k=2, capacity_factor=capacity_factor,
                                     bits=bits, seed=3, dtype=torch.float64))
    exact = ExpertParallelMoE(MoELayer(HIDDEN, 16, 4, k=2, capacity_factor=capacity_factor,
                                       seed=3, dtype=torch.float64))
    # tokens around a few centres (tight clusters, as LSH needs to compress, for small noise)
    centres = _tokens(1, seed=8)[:3]
    x_all = centres[torch.arange(size * TOKENS_PER_RANK) % 3] + noise * _tokens(size)
    x = _mine(x_all)
    own = LSHMoE(HIDDEN, 16, 4, k=2, capacity_factor=capacity_factor, bits=bits, seed=3,
                 dtype=torch.float64)
    with collectives.meter() as m:
        y = layer(x)
    return {"vs_own_lsh": torch.allclose(y, own(x), rtol=1e-10, atol=1e-12),
            "vs_exact": torch.allclose(y, exact(x), rtol=1e-10, atol=1e-12),
            "rows": layer.last_rows, "own_rows": own.last_rows, "bytes": m.sent_bytes}


def test_lsh_expert_parallel_sends_each_ranks_bucket_means(cluster4):
    # no drops (capacity = every token): each rank's output is its own one-process LSH-MoE's
    results = cluster4.run(_lsh, 2, 0.01)
    for r in results:
        assert r["vs_own_lsh"] and r["rows"] == r["own_rows"], r
        routed, sent = r["rows"]
        assert sent < routed  # similar tokens shared a centroid
    wide = cluster4.run(_lsh, 40, 1.0)  # spread out, 40 planes: every token its own bucket
    for r, narrow in zip(wide, results, strict=True):
        assert r["vs_exact"] and r["rows"][0] == r["rows"][1], r
        assert narrow["bytes"] < r["bytes"]  # fewer rows through the all-to-all


def _every_rule_on_every_exchange():
    from minipar.mesh import Mesh
    from minipar.moe import ChunkedAllToAll, DroplessMoE, HierarchicalAllToAll

    groups = Mesh(node=2, local=2).connect()
    x = _mine(_tokens(minipar.world_size()))
    wrong = []
    for make in (MoELayer, DroplessMoE, ExpertChoiceMoE, LSHMoE):
        twin = make(HIDDEN, 16, 4, k=2, capacity_factor=1.0, seed=3, dtype=torch.float64)
        flat = ExpertParallelMoE(twin)(x)
        for exchange in (HierarchicalAllToAll(groups.local, groups.node), ChunkedAllToAll(2)):
            y = ExpertParallelMoE(twin, exchange=exchange)(x)
            if not torch.allclose(y, flat, rtol=1e-12, atol=1e-14):
                wrong.append((make.__name__, repr(exchange)))
    return wrong


def test_every_routing_rule_composes_with_every_exchange(cluster4):
    # the rule and the exchange are separate objects: any pair gives the flat layer's rows
    assert cluster4.run(_every_rule_on_every_exchange) == [[]] * 4
