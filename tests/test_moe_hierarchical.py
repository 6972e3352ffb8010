"""Tutel's hierarchical all-to-all equals the flat one, with fewer messages across nodes."""

import pytest
import torch
from conftest import value_errors

from minipar import collectives
from minipar.mesh import Mesh
from minipar.moe.hierarchical import all_to_all_time, hierarchical_all_to_all
from minipar.runtime import rank, world_size


def _counts(src, k):
    gen = torch.Generator().manual_seed(30 + src)
    counts = torch.randint(0, 5, (k,), generator=gen).tolist()
    if src == 1:
        counts[2] = 0  # an empty message must still line up
    return counts


def _both(nodes, per_node):
    groups = Mesh(node=nodes, local=per_node).connect()
    me, k = rank(), world_size()
    counts = _counts(me, k)
    x = torch.arange(sum(counts), dtype=torch.float64)[:, None] + 1000 * me + torch.zeros(1, 3)
    with collectives.meter() as flat_meter:
        flat = collectives.all_to_all(x, counts)
    meters = {}
    hier = hierarchical_all_to_all(x, counts, groups.local, groups.node, meters)
    return (torch.equal(flat, hier), flat_meter.messages, meters["inside"].messages,
            meters["across"].messages, meters["across"].sent_bytes)


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (4, 1), (1, 4)])
def test_hierarchical_equals_flat(cluster4, nodes, per_node):
    for same, *_ in cluster4.run(_both, nodes, per_node):
        assert same


def test_fewer_messages_cross_nodes():
    import minipar

    with minipar.Cluster(8, backend="gloo", timeout=60) as cluster:
        results = cluster.run(_both, 2, 4)
    for same, _, _, across_messages, _ in results:
        assert same
        assert across_messages <= 1  # one aggregated message to the other node (at most)


def test_the_model_says_where_hierarchy_wins():
    small, big = 64 * 1024, 512 * 2**20
    args = (16, 8, 2e-6, 1 / 300e9, 20e-6, 1 / 25e9)  # 16 nodes of 8, NVLink vs InfiniBand
    assert all_to_all_time("hierarchical", small, *args) < all_to_all_time("flat", small, *args)
    def gain(nbytes, link=args):
        return all_to_all_time("flat", nbytes, *link) / all_to_all_time("hierarchical", nbytes,
                                                                        *link)

    assert gain(small) > 3 > gain(big) > 1  # latency saved matters less as messages grow
    pcie = (16, 8, 2e-6, 1 / 16e9, 20e-6, 1 / 25e9)  # a slow link inside the node
    assert gain(big, pcie) < 1  # moving the data twice inside the node now costs more
    with pytest.raises(ValueError, match="'flat' or 'hierarchical'"):
        all_to_all_time("2d", small, *args)


def _flat_and_hierarchical_ep():
    from minipar.moe import ExpertParallelMoE, HierarchicalAllToAll, MoELayer

    groups = Mesh(node=2, local=2).connect()
    twin = MoELayer(8, 16, num_experts=4, k=2, capacity_factor=0.75, seed=3,
                    dtype=torch.float64)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank()), dtype=torch.float64)
    out = []
    for exchange in (None, HierarchicalAllToAll(groups.local, groups.node)):
        layer = ExpertParallelMoE(twin, exchange=exchange)
        y = layer(x)
        y.pow(2).sum().backward()
        out.append((y.detach(), [p.grad for p in layer.parameters()]))
    (y1, g1), (y2, g2) = out
    return torch.equal(y1, y2) and all(torch.allclose(a, b) for a, b in zip(g1, g2, strict=True))


def test_expert_parallel_layer_with_the_hierarchical_exchange_is_unchanged(cluster4):
    assert all(cluster4.run(_flat_and_hierarchical_ep))


def test_exchange_plan_ends_where_the_flat_one_does():
    from minipar.moe.hierarchical import exchange_plan

    counts = [[(s * 7 + d * 3) % 4 for d in range(8)] for s in range(8)]
    flat = exchange_plan(counts, 2, 4, "flat")
    hier = exchange_plan(counts, 2, 4, "hierarchical")
    assert len(flat) == 2 and len(hier) == 3
    assert flat[-1]["holds"] == hier[-1]["holds"]
    for d, held in enumerate(hier[-1]["holds"]):
        assert all(dst == d for _, dst in held) and [s for s, _ in held] == sorted(
            s for s, _ in held)  # sources in rank order, as the flat exchange delivers

    def across(sent):
        return sum(1 for s in range(8) for d in range(8) if sent[s][d] and s // 4 != d // 4)

    assert across(hier[2]["sent"]) < across(flat[1]["sent"])
    assert across(hier[1]["sent"]) == 0  # step 1 stays inside the nodes
    with pytest.raises(ValueError, match="'flat' or 'hierarchical'"):
        exchange_plan(counts, 2, 4, "ring")


def _chunked_ep(chunks):
    from minipar.moe import ChunkedAllToAll, ExpertParallelMoE, MoELayer

    twin = MoELayer(8, 16, num_experts=4, k=2, capacity_factor=0.75, shared_expert=True,
                    seed=3, dtype=torch.float64)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(rank()), dtype=torch.float64)
    out = []
    for exchange in (None, ChunkedAllToAll(chunks)):
        layer = ExpertParallelMoE(twin, exchange=exchange)
        y = layer(x)
        y.pow(2).sum().backward()
        out.append((y.detach(), [p.grad for p in layer.parameters()]))
    (y1, g1), (y2, g2) = out
    return bool(torch.allclose(y1, y2, rtol=1e-12)) and all(
        torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(g1, g2, strict=True))


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_pipelined_dispatch_equals_the_plain_layer(cluster4, cluster2, chunks):
    assert all(cluster4.run(_chunked_ep, chunks)) and all(cluster2.run(_chunked_ep, chunks))


def _choose():
    from minipar.moe import ExpertParallelMoE, MoELayer
    from minipar.moe.pipelining import choose_chunks

    layer = ExpertParallelMoE(MoELayer(16, 32, num_experts=4, k=2, seed=1))
    times = choose_chunks(layer, torch.randn(64, 16), candidates=(1, 2), repeats=2)
    return times, layer.exchange.chunks


def test_choose_chunks_keeps_the_fastest_and_every_rank_agrees(cluster2):
    results = cluster2.run(_choose)
    assert results[0] == results[1]  # the slowest rank's times, the same choice everywhere
    times, chosen = results[0]
    assert chosen == min(times, key=times.get)


def _launcher_nodes():
    from minipar.moe import HierarchicalAllToAll, node_mesh

    exchange = HierarchicalAllToAll()  # spawned ranks share one machine: one node of 4
    me, k = rank(), world_size()
    counts = _counts(me, k)
    x = torch.arange(sum(counts), dtype=torch.float64)[:, None] + 1000 * me
    flat = collectives.all_to_all(x, counts)
    hier = hierarchical_all_to_all(x, counts, exchange.local_group, exchange.node_group)
    shape = (world_size(exchange.node_group), world_size(exchange.local_group))
    return torch.equal(flat, hier), shape, node_mesh(2).shape, value_errors(lambda: node_mesh(3))


def test_the_exchange_takes_its_nodes_from_the_launcher(cluster4):
    for same, shape, given, refused in cluster4.run(_launcher_nodes):
        assert same and shape == (1, 4) and given == (2, 2)
        assert refused == ["per_node must divide the 4 ranks; got 3"]
