"""SBP placements: every conversion run on real ranks equals the logical tensor, the
derived MLP chain finds Megatron's split, and cross-mesh resharding delivers the pieces."""

import pytest
import torch

import minipar
from minipar.mesh.reshard import reshard, reshard_plan
from minipar.mesh.sbp import (
    Broadcast,
    Partial,
    Split,
    conversion,
    convert,
    derive,
    mlp_placements,
    placement,
    run_chain,
)

PLACEMENTS = ["S(0)", "S(1)", "B", "P"]


def _local(full, where, me, k):
    """This rank's part of `full` placed `where` (partial: rank r holds full * (r+1) / sum)."""
    p = placement(where)
    if isinstance(p, Split):
        return full.chunk(k, p.dim)[me].clone()
    if isinstance(p, Broadcast):
        return full.clone()
    return full * (me + 1) / (k * (k + 1) / 2)


def _logical(parts, where, k):
    p = placement(where)
    if isinstance(p, Split):
        return torch.cat(parts, p.dim)
    if isinstance(p, Broadcast):
        assert all(torch.allclose(q, parts[0]) for q in parts)
        return parts[0]
    return sum(parts)


def _every_conversion():
    me, k = minipar.rank(), minipar.world_size()
    full = torch.arange(8 * 12, dtype=torch.float64).view(8, 12)
    return {(s, t): convert(_local(full, s, me, k), s, t) for s in PLACEMENTS
            for t in PLACEMENTS}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_conversion_keeps_the_logical_tensor(world_size, cluster2, cluster4):
    cluster = cluster2 if world_size == 2 else cluster4
    results = cluster.run(_every_conversion)
    full = torch.arange(8 * 12, dtype=torch.float64).view(8, 12)
    for key in results[0]:
        torch.testing.assert_close(_logical([r[key] for r in results], key[1], world_size),
                                   full, msg=str(key))


def test_conversions_are_named_and_priced():
    assert conversion("S(0)", "B", 1000, 4).collective == "all_gather"
    assert conversion("P", "B", 1000, 4).collective == "all_reduce"
    assert conversion("P", "S(1)", 1000, 4).collective == "reduce_scatter"
    assert conversion("B", "S(0)", 1000, 4).collective == "local slice"
    a2a = conversion("S(0)", "S(1)", 1000, 4, alpha=1e-3, beta=1e-6)
    assert a2a.collective == "all_to_all" and a2a.bytes_sent == pytest.approx(187.5)
    assert a2a.seconds == pytest.approx(3e-3 + 187.5e-6)
    # an all-reduce sends what an all-gather plus a reduce-scatter send
    assert conversion("P", "B", 1000, 4).bytes_sent == pytest.approx(
        conversion("S(0)", "B", 1000, 4).bytes_sent + conversion("P", "S(0)", 1000, 4).bytes_sent)
    assert placement("s( 1 )") == Split(1) and placement("p") == Partial()
    with pytest.raises(ValueError, match="placement must be"):
        placement("R")


def test_the_derived_mlp_chain_is_megatrons():
    steps = derive([("matmul", "S(1)", 4.0), ("elementwise", ""), ("matmul", "S(0)", 0.25)])
    assert [str(s.output) for s in steps] == ["S(1)", "S(1)", "P", "B"]
    assert [s.before.collective if s.before else None for s in steps] == \
        [None, None, None, "all_reduce"]
    best = mlp_placements(ranks=4)
    assert best[0][:2] == ("S(1)", "S(0)") and best[0][3] == "all_reduce"
    assert best[0][2] < best[1][2]


def _chains():
    torch.manual_seed(0)
    x, up, down = (torch.randn(6, 8, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64),
                   torch.randn(16, 8, dtype=torch.float64))
    want = torch.nn.functional.gelu(x @ up) @ down
    gaps = []
    for up_place, down_place, _, _ in mlp_placements(minipar.world_size()):
        steps = derive([("matmul", up_place, 4.0), ("elementwise", ""),
                        ("matmul", down_place, 0.25)])
        gaps.append((run_chain(x, [up, down], steps) - want).abs().max().item())
    return gaps


def test_every_derived_chain_computes_the_mlp(cluster4):
    for gaps in cluster4.run(_chains):
        assert max(gaps) < 1e-12


def test_reshard_plan_sends_each_overlap_once():
    plan = reshard_plan(12, [0, 1], "S(0)", [1, 2, 3], "S(0)")
    assert [(m.src, m.dst, m.start, m.stop) for m in plan] == \
        [(0, 1, 0, 4), (0, 2, 4, 6), (1, 2, 6, 8), (1, 3, 8, 12)]
    assert sum(m.stop - m.start for m in reshard_plan(12, [0], "B", [2, 3], "S(0)")) == 12
    with pytest.raises(ValueError, match="same dimension"):
        reshard_plan(12, [0, 1], "S(0)", [2, 3], "S(1)")


def _cross_mesh(src_ranks, src, dst_ranks, dst):
    me = minipar.rank()
    full = torch.arange(12 * 3, dtype=torch.float32).view(12, 3)
    local = None
    if me in src_ranks:
        local = full if src == "B" else full.chunk(len(src_ranks))[src_ranks.index(me)]
    got = reshard(local, (12, 3), src_ranks, src, dst_ranks, dst)
    if got is None:
        return None
    want = full if dst == "B" else full.chunk(len(dst_ranks))[dst_ranks.index(me)]
    return torch.equal(got, want)


@pytest.mark.parametrize("case", [([0, 1], "S(0)", [1, 2, 3], "S(0)"),
                                  ([0, 1, 2], "S(0)", [3], "B"),
                                  ([2, 3], "B", [0, 1], "S(0)")])
def test_cross_mesh_resharding_delivers_each_destination_its_piece(case, cluster4):
    results = cluster4.run(_cross_mesh, *case)
    assert [r for r in results if r is not None] == [True] * len(case[2])
