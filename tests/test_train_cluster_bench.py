"""`minipar bench cluster`'s structural facts on 2 emulated nodes x 2 ranks, counted by the
emulated network (never timed): the hierarchical all-to-all sends half the flat one's
messages across the nodes, the same bytes, and is charged less for them; the decoder step
with tp inside the nodes sends fewer messages and bytes across than with tp across, and
the planner predicts it faster."""

import pytest

from minipar.collectives import Link
from minipar.cost import TransformerConfig
from minipar.mesh.bench import BATCH, MICROBATCHES, SHAPE
from minipar.mesh.planner import Hardware, Layout, estimate
from minipar.train.cluster_bench import ACROSS, LAYOUTS, ORDERS, exchanges, layout_steps


def test_hierarchical_all_to_all_sends_fewer_messages_across(cluster4):
    for (found,) in cluster4.run(exchanges, 3, 1):
        flat, hier = found["flat"], found["hierarchical"]
        # flat: one message to each of the 2 ranks of the other node; hierarchical: one
        assert (flat["messages"], hier["messages"]) == (2, 1)
        assert flat["bytes"] == hier["bytes"] == 2 * 3 * 64 * 4
        assert hier["charged"] < flat["charged"]  # the emulated charge, not a clock


def test_tp_inside_the_nodes_crosses_less_and_is_predicted_faster(cluster4):
    crossing = {}
    for name, dims in LAYOUTS.items():
        # the warm-up step alone, untimed, on a free link between the nodes: counted only
        runs = cluster4.run(layout_steps, dims, 0, Link())
        crossing[name] = (max(r["messages"] for r in runs), max(r["bytes"] for r in runs))
    inside, across = crossing["tp inside, dp across"], crossing["tp across, dp inside"]
    assert inside[0] < across[0] and inside[1] < across[1], crossing
    model = TransformerConfig(SHAPE["layers"], SHAPE["hidden"], SHAPE["heads"],
                              SHAPE["seq_len"], SHAPE["vocab"])
    cluster = Hardware(2, 2, 1e11, 1e12, 5e9, ACROSS.bandwidth, intra_latency=1e-4,
                       inter_latency=ACROSS.latency, efficiency=1.0)
    layout = Layout(2, 1, 2, micro_batch=BATCH // (2 * MICROBATCHES), recompute="none")
    steps = {name: estimate(model, cluster, BATCH, layout, 4, order=ORDERS[name])
             for name in LAYOUTS}
    assert steps["tp inside, dp across"].step < steps["tp across, dp inside"].step
    with pytest.raises(ValueError, match="order must name each of"):
        estimate(model, cluster, BATCH, layout, order=("dp", "tp"))
