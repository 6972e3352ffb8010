"""The planner: published configurations fit and land near their published throughput,
tensor parallelism stays inside a node, mixed NICs move data parallelism off slow links."""

import pytest

from minipar.cost import OPT_CONFIGS, TransformerConfig
from minipar.mesh.planner import Hardware, Layout, estimate, explain, plan, selene

# Narayanan et al. 2021, Table 1: (model, nodes of 8 A100, batch, pp, tp, TFLOP/s per GPU)
MEGATRON = [(TransformerConfig(80, 12288, 96, 2048, 51200), 192, 2304, 8, 8, 148),
            (TransformerConfig(128, 25600, 160, 2048, 51200), 384, 3072, 64, 8, 163)]


@pytest.mark.parametrize("model, nodes, batch, pp, tp, published", MEGATRON)
def test_published_megatron_runs_fit_and_land_a_little_above_their_throughput(
        model, nodes, batch, pp, tp, published):
    cluster = selene(nodes)
    dp = cluster.devices // (pp * tp)
    run = estimate(model, cluster, batch, Layout(dp, pp, tp, micro_batch=1, recompute="full"))
    assert run.memory < cluster.memory_bytes
    # the estimate leaves out overheads, so it is an optimistic bound, within 25%
    assert published < run.tflops_per_device < 1.25 * published
    best = plan(model, cluster, batch)[0]
    assert best.tp <= cluster.devices_per_node  # the tensor-parallel-within-a-node rule
    assert best.step <= run.step
    assert "TFLOP/s per device" in explain(best, cluster)


def test_what_does_not_fit_is_left_out():
    cluster = selene(1)
    big = OPT_CONFIGS["175B"]
    assert plan(big, cluster, 8) == []  # 175B on 8 GPUs: 2.8 TB of states
    assert all(p.memory <= cluster.memory_bytes for p in plan(OPT_CONFIGS["13B"], cluster, 8))


def test_mixed_nics_keep_data_parallelism_off_the_slow_path():
    nics = (25e9, 25e9, 12.5e9, 12.5e9)  # two InfiniBand nodes, two RoCE nodes
    holmes = Hardware(4, 8, 312e12, 80e9, 300e9, nics, cross_nic_bandwidth=1.25e9)
    model = OPT_CONFIGS["13B"]
    across = estimate(model, holmes, 256, Layout(4, 1, 8, zero=1))  # dp spans both kinds
    inside = estimate(model, holmes, 256, Layout(2, 2, 8, zero=1))  # pp crosses, dp inside
    assert across.seconds["dp"] > 10 * inside.seconds["dp"]
    assert inside.step < across.step
    best = plan(model, holmes, 256)[0]
    assert best.pp > 1  # the slow boundary is crossed by pipeline sends only


@pytest.mark.parametrize("kwargs, words", [
    (dict(dp=3, pp=1, tp=1), "dp \\* pp \\* tp must equal the cluster's 8 devices"),
    (dict(dp=8, pp=1, tp=1, micro_batch=3), "global_batch=16 must be a multiple"),
])
def test_bad_configurations_say_what_to_change(kwargs, words):
    with pytest.raises(ValueError, match=words):
        estimate(OPT_CONFIGS["1.3B"], selene(1), 16, Layout(**kwargs))


def test_explain_tells_a_pipeline_to_fit_from_one_for_its_links():
    cluster = Hardware(2, 8, 312e12, 80e9, 300e9, 25e9)
    plans = plan(OPT_CONFIGS["13B"], cluster, 64)
    best = plans[0]
    assert best.pp > 1 and any(p.pp == 1 for p in plans)  # it would fit without a pipeline
    assert "is not needed to fit; it puts the links between nodes on the pipeline" in \
        explain(best, cluster, plans)
    small = Hardware(2, 8, 312e12, 16e9, 300e9, 25e9)
    plans = plan(OPT_CONFIGS["13B"], small, 64)
    assert all(p.pp > 1 for p in plans)
    assert f"pp={plans[0].pp} splits the model so it fits" in explain(plans[0], small, plans)
