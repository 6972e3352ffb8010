"""The mesh: its layout, and the tiny decoder trained on compositions of data, pipeline
and tensor parallelism equal to one process (the trainer's compositions, ZeRO-2/3 and
HSDP among them, are test_train_composed.py's)."""

import pytest

import minipar
from minipar.mesh import Mesh
from minipar.mesh.model import MeshModel
from minipar.mesh.twin_check import check_against_twin
from minipar.moe.on_mesh import check_moe_against_twin


def test_ranks_are_row_major_with_the_last_dimension_fastest():
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.size == 8 and mesh["pp"] == 2
    assert mesh.coords(5) == {"dp": 1, "pp": 0, "tp": 1}
    assert all(mesh.rank_at(**mesh.coords(r)) == r for r in range(8))
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for name in mesh.names:  # each dimension's groups cover every rank exactly once
        assert sorted(r for g in mesh.groups(name) for r in g) == list(range(8))
    assert mesh.group_of("dp", 6) == [2, 6]
    lines = mesh.table().splitlines()
    assert lines[0].split()[:4] == ["rank", "dp", "pp", "tp"] and len(lines) == 10
    assert lines[7].split() == ["5", "1", "0", "1", "1", "5", "5", "7", "4", "5"]


@pytest.mark.parametrize("call, words", [
    (lambda: Mesh(), "at least one dimension"),
    (lambda: Mesh(dp=0), "dimension dp must be a positive int"),
    (lambda: Mesh(dp=2).groups("tp"), r"dimension must be one of \('dp',\)"),
    (lambda: Mesh(dp=2, tp=2).coords(4), r"rank must be in 0..3"),
    (lambda: Mesh(dp=2, tp=2).rank_at(dp=1), "name every dimension"),
])
def test_bad_mesh_input_names_what_to_change(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_connecting_a_mesh_of_the_wrong_size_says_so(cluster2):
    def attempt():
        try:
            Mesh(dp=2, tp=2).connect()
        except ValueError as error:
            return str(error)
    assert all("has 4 ranks but this run has 2" in e for e in cluster2.run(attempt))


def _assert_equal_to_one_process(results, dims):
    for r in results:
        assert r["loss_gap"] < 1e-12 and r["wrong_grads"] == [] and r["wrong_params"] == [], r
    last = [r for r in results if r["coords"]["pp"] == dims["pp"] - 1]
    assert last and all(len(r["losses"]) == 2 for r in last)  # the last stage saw each loss
    assert all(r["losses"] == [] for r in results if r["coords"]["pp"] != dims["pp"] - 1)


@pytest.mark.parametrize("dims", [dict(dp=1, pp=4, tp=1), dict(dp=1, pp=1, tp=4),
                                  dict(dp=2, pp=2, tp=1), dict(dp=2, pp=1, tp=2),
                                  dict(dp=1, pp=2, tp=2)])
@pytest.mark.parametrize("zero", [False, True], ids=["adam", "zero1"])
def test_every_composition_on_4_ranks_trains_like_one_process(dims, zero, cluster4):
    _assert_equal_to_one_process(cluster4.run(check_against_twin, dims, zero), dims)


# every (dp, pp, tp) of 8 the 4-block, 4-head model allows (pp <= 4 blocks, tp <= 4 heads)
EIGHT = [dict(dp=8, pp=1, tp=1), dict(dp=4, pp=2, tp=1), dict(dp=4, pp=1, tp=2),
         dict(dp=2, pp=4, tp=1), dict(dp=2, pp=1, tp=4), dict(dp=1, pp=4, tp=2),
         dict(dp=1, pp=2, tp=4), dict(dp=2, pp=2, tp=2)]


@pytest.mark.slow  # every composition on 8 ranks time-sharing 2 cores
def test_every_composition_on_8_ranks_trains_like_one_process():
    with minipar.Cluster(8, backend="gloo", timeout=60) as cluster:
        for dims in EIGHT:
            microbatches = 1 if dims["dp"] == 8 else 2  # 8 rows: one per replica at dp=8
            for zero in (False, True) if dims["dp"] > 1 else (False,):
                results = cluster.run(check_against_twin, dims, zero, 2, microbatches)
                _assert_equal_to_one_process(results, dims)


def _without_tied_sum(dims):
    kept = MeshModel.sum_tied_gradients
    MeshModel.sum_tied_gradients = lambda self: None  # in this rank's process, for this run
    try:
        return check_against_twin(dims, steps=1)
    finally:
        MeshModel.sum_tied_gradients = kept


def test_the_tied_embedding_needs_its_gradients_summed_across_pipeline_ends(cluster2):
    results = cluster2.run(_without_tied_sum, dict(dp=1, pp=2, tp=1))
    assert all("embed.weight" in r["wrong_grads"] for r in results)


@pytest.mark.parametrize("dims", [{"dp": 2, "ep": 2}, {"ep": 4}, {"ep": 2, "dp": 2}],
                         ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_experts_over_ep_inside_dp_train_like_one_process(cluster4, dims):
    results = cluster4.run(check_moe_against_twin, dims)
    mesh = Mesh(**dims)
    for r, res in enumerate(results):
        assert res["loss_gap"] < 1e-12, (r, res)
        assert res["wrong_grads"] == [] and res["wrong_params"] == [], (r, res)
        ep = mesh.coords(r)["ep"]
        assert res["experts"] == list(range(ep * 4 // mesh["ep"], (ep + 1) * 4 // mesh["ep"]))


def _experts_averaged_like_dense(dims):
    from minipar.moe import on_mesh

    kept = on_mesh.data_parallel
    on_mesh.data_parallel = lambda layer, dp_group, ep_size: kept(layer, dp_group, 1)
    try:
        return check_moe_against_twin(dims, steps=1)
    finally:
        on_mesh.data_parallel = kept


def test_expert_gradients_need_dividing_by_the_ep_size(cluster4):
    for res in cluster4.run(_experts_averaged_like_dense, {"dp": 2, "ep": 2}):
        assert res["wrong_grads"] and all(n.startswith("experts.") for n in res["wrong_grads"])
