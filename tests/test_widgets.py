"""Renderers draw without a browser; the viewers cache frames and answer their controls."""


import pytest
import torch
from test_trace import two_rank_timeline

from minipar.plots import render_summary, render_timeline, to_png
from minipar.trace import Timeline
from minipar.widgets import TimelineViewer


def test_render_timeline_draws_one_row_per_rank_and_clips_at_upto():
    timeline = two_rank_timeline()
    fig = render_timeline(timeline)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.collections) == len(timeline)
    partial = render_timeline(timeline, upto=1.1).axes[0]
    assert len(partial.collections) == 4  # events started by t=1.1
    assert to_png(fig).startswith(b"\x89PNG")


def test_render_summary_and_empty_timeline():
    assert to_png(render_summary(two_rank_timeline())).startswith(b"\x89PNG")
    assert render_timeline(Timeline()).axes


def test_viewer_sends_the_timeline_as_data_for_the_browser():
    timeline = two_rank_timeline()
    viewer = TimelineViewer(timeline, title="two ranks")
    [panel] = viewer.view.panels
    assert panel["title"] == "two ranks" and panel["lanes"] == ["rank 0", "rank 1"]
    assert len(panel["events"]) == len(timeline)
    lane, kind, label, start, end, _micro, _compute = panel["events"][0]
    first = timeline.events[0]
    assert (lane, kind, label) == (timeline.ranks.index(first.rank), first.kind, first.label)
    assert start == pytest.approx((first.start - timeline.start) * 1e3)
    assert end == pytest.approx((first.end - timeline.start) * 1e3)
    assert set(panel["colors"]) == {e.kind for e in timeline}
    assert viewer.view._esm and "export default" in str(viewer.view._esm)
    with pytest.raises(ValueError, match="play_ms"):
        TimelineViewer(timeline, play_ms=0)


def test_collective_recording_matches_the_meter_and_renders(cluster4):
    from minipar import cost
    from minipar.widgets import (
        CollectiveAnimator,
        record_all_reduce,
        render_collective_frame,
        render_collective_strip,
    )

    recording = record_all_reduce("ring", 4, cluster=cluster4)
    assert recording.frames == 2 * 3 + 1
    assert recording.initial[2] == [4.0] * 8  # rank r starts at 2^r
    assert all(buffer == [15.0] * 8 for buffer in recording.steps[-1].buffers)
    # after reduce-scatter step 0, rank 1 holds ranks 0+1 (1 + 2) in the chunk it received
    assert recording.steps[0].buffers[1][6:8] == [3.0, 3.0]
    model = cost.all_reduce_cost("ring", 4, 8 * 4)
    assert recording.link_bytes(recording.frames - 1).sum() == model.total_bytes
    assert render_collective_frame(recording, 3).axes
    assert to_png(render_collective_strip(recording)).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="frame must be in 0..6"):
        render_collective_frame(recording, 7)
    with pytest.raises(ValueError, match="world_size must be an int from 2 to 8"):
        record_all_reduce("ring", 9)
    animator = CollectiveAnimator("tree", 2)
    data = animator.view.recording
    assert len(data["steps"]) == animator.recording.frames - 1 == 2 and data["total"] == 3
    assert data["steps"][-1]["buffers"] == [[3.0] * 4, [3.0] * 4]
    animator.show(2)
    assert animator.view.frame == 2
    with pytest.raises(ValueError, match="frame must be in 0..2"):
        animator.show(3)
    animator.algorithm.value = "ring"  # a new choice runs at once: the picture is current
    assert animator.view.recording["title"] == "all_reduce, ring, 2 ranks"
    assert animator.view.frame == 0 and animator.view.greyed == ""
    assert "ring, 2 ranks: 2 steps" in animator.status.value
    animator.stop()  # ranks shut down, the picture stays
    assert animator.view.recording["title"] == "all_reduce, ring, 2 ranks"
    animator.close()
    with pytest.raises(ValueError, match="algorithm must be one of"):
        CollectiveAnimator("star", 2)


@pytest.mark.slow  # the widget measures real ranks
def test_speedup_lab_measures_real_ranks_and_draws():
    from minipar.widgets import SpeedupLab, render_speedup

    lab = SpeedupLab(ranks=2, width=128, per_rank=8)
    rows = lab.measure()
    assert [r["ranks"] for r in rows] == [1, 2] and rows[0]["speedup"] == 1.0
    assert all(r["compute"] > 0 and r["model_speedup"] > 0 for r in rows)
    assert rows[1]["comm"] > 0  # two ranks exchange gradients; one does not
    assert lab.view.frames[0].startswith("<svg") and "best:" in lab.status.value
    lab.width.value = 256  # the picture is now of other settings: greyed, and says so
    assert "settings changed" in lab.view.greyed
    assert render_speedup(rows).axes


@pytest.mark.slow  # the widget measures real ranks
def test_schedule_explorer_simulates_reports_and_measures():
    from minipar.widgets import ScheduleExplorer, render_pipeline

    explorer = ScheduleExplorer("1f1b", 4, 8)
    assert "bubble 27.3%" in explorer.status.value and "[4, 3, 2, 1]" in explorer.status.value
    explorer.name.value = "interleaved_1f1b"
    explorer.virtual.value = 2
    drawn = explorer.view.panels
    explorer.microbatches.value = 6
    assert "microbatches must be a multiple of 4" in explorer.status.value
    # what you see is the current input: an impossible choice greys the picture, says why
    assert "multiple of 4" in explorer.view.greyed and explorer.view.panels == drawn
    explorer.microbatches.value = 8
    assert explorer.view.greyed == ""
    explorer.fill.value = True
    assert "utilization" in explorer.status.value
    assert any(e[1] == "extra" for e in explorer.view.panels[0]["events"])
    held = explorer.view.panels[-1]
    assert held["kind"] == "steps" and len(held["series"]) == 4
    explorer.fill.value = False
    # a V holds its two stages per rank whatever the virtual slider says; only its
    # overlapped F&B pairs shorten when the overlap slider says a machine overlaps them
    explorer.virtual.value = 1
    explorer.name.value = "dualpipev"
    assert explorer.plan.virtual == 2 and "[9, 9, 9, 9]" in explorer.status.value
    sequential = explorer.ideal.makespan
    explorer.overlap.value = 0.7
    assert explorer.ideal.makespan < sequential
    explorer.overlap.value = 1.0
    explorer.name.value, explorer.stages.value = "gpipe", 2
    measured = explorer.measure()
    assert sorted({e.kind for e in measured} & {"F", "B"}) == ["B", "F"]
    assert "measured bubble" in explorer.status.value and "predicted" in explorer.status.value
    # the prediction from the run's own costs is drawn on the measured run's time axis
    assert {e.label for e in explorer.predicted if e.track == "compute"} == \
        {e.label for e in measured if e.track == "compute"}
    ideal, predicted, real, _held = explorer.view.panels
    assert predicted["axis_ms"] == real["axis_ms"] and not real["plays"] and ideal["plays"]
    figure = render_pipeline(explorer.ideal, measured, predicted=explorer.predicted)
    assert len(figure.axes) == 4 and figure.axes[1].get_xlim() == figure.axes[2].get_xlim()


def test_split_frames_render_for_every_kind_and_size():
    from minipar.widgets import SPLIT_KINDS, render_split, split_frames, split_viewer

    for kind in SPLIT_KINDS:
        for tp_size in (1, 2, 4):
            for frame in range(len(split_frames(kind))):
                assert render_split(kind, tp_size, frame).axes
    with pytest.raises(ValueError, match="kind must be one of"):
        split_frames("diagonal")
    with pytest.raises(ValueError, match="tp must be 1 to 4"):
        render_split("row", 8, 0)
    box = split_viewer("row", 2)
    view = box.children[-1]
    assert len(view.frames) == len(split_frames("row"))
    assert view.captions[0].startswith("step 1 of 4")
    sizes = {svg[:svg.index(">")].split("viewBox=")[1] for svg in view.frames}
    assert len(sizes) == 1  # every step drawn at one size: Play never resizes the page
    box.children[0].children[0].value = "column"
    assert len(view.frames) == len(split_frames("column"))


def test_router_explorer_draws_routing_and_trains():
    from minipar.moe import route
    from minipar.widgets import RouterExplorer, render_routing

    routing = route(torch.randn(12, 4), k=2, capacity_factor=0.5)
    assert render_routing(routing, "test").axes
    box = RouterExplorer(tokens=16, hidden=8)
    assert isinstance(box, RouterExplorer)
    view = box.children[-1]
    first = view.frames
    box.children[1].children[2].click()  # train 20 steps
    assert view.frames != first and "after 20 training steps" in view.frames[0]
    box.children[1].children[0].value = 4  # fewer experts: a new, untrained layer
    assert "untrained" in view.frames[0]
    box.children[1].children[2].click()
    assert "after 20 training steps" in view.frames[0]  # the count starts again
    box.children[0].children[0].value = 4  # k = 4 with 4 experts is fine
    box.children[1].children[0].value = 2  # 2 experts with k = 4 is not
    assert "k must be at most" in box.children[2].value and "more than" in view.greyed
    box.children[1].children[0].value = 8
    assert view.greyed == "" and "untrained" in view.frames[0]


def test_memory_explorer_follows_its_inputs_and_says_what_fits():
    from minipar.widgets import MemoryExplorer

    explorer = MemoryExplorer(params=65e9, ranks=64, mixed=True, device_gb=80)
    assert explorer.status.value.startswith("fits in 80 GB: ZeRO-3 &middot;")
    first = explorer.view.frames
    explorer.ranks.value = 1024  # ZeRO-2's gradients and optimizer state shrink below 80 GB?
    rows = explorer.rows()
    assert rows[2]["gradients"] == pytest.approx(2 * 65e9 / 1024)
    assert explorer.view.frames != first  # the picture is the current input
    explorer.params.value = 1e8
    assert "data parallel, ZeRO-1, ZeRO-2, ZeRO-3 &middot;" in explorer.status.value


def test_memory_explorer_activations_follow_recomputation_and_micro_batch():
    from minipar import cost
    from minipar.widgets import MemoryExplorer

    explorer = MemoryExplorer(params=175e9, ranks=8, recompute="none", micro_batch=1,
                              seq_len=2048)
    assert explorer.shape() == (96, 12288, 96)  # GPT-3's shape from its parameter count
    none = explorer.rows()[3]["activations"]
    assert none == cost.activation_bytes(96, 12288, 2048, 1, 96, "none")
    explorer.recompute.value = "selective"
    selective = explorer.rows()[3]["activations"]
    explorer.recompute.value = "full"
    full = explorer.rows()[3]["activations"]
    assert none > selective > full
    explorer.micro_batch.value = 4
    assert explorer.rows()[0]["activations"] == pytest.approx(4 * full)
    explorer.precision.value = "float32"
    assert explorer.rows()[0]["activations"] == pytest.approx(8 * full)


@pytest.mark.slow  # the widget measures each ZeRO stage on ranks
def test_memory_explorer_measures_each_stage_beside_the_formula():
    from minipar.widgets import MemoryExplorer

    explorer = MemoryExplorer(mixed=False)
    rows = explorer.measure()
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        for kind in ("parameters", "gradients", "optimizer"):
            assert row[kind] == pytest.approx(row[f"formula_{kind}"], rel=0.1)
    assert "measured" in explorer.view.frames[0]


def test_mesh_viewer_shows_the_clicked_ranks_groups_and_follows_the_shape():
    from minipar.mesh import Mesh
    from minipar.widgets import MeshViewer

    viewer = MeshViewer(dp=2, pp=2, tp=2)
    assert list(viewer.ranks.options) == list(range(8))
    first = viewer.view.frames
    viewer.ranks.value = 5
    assert "rank 5 (dp=1, pp=0, tp=1)" in viewer.status.value
    for name, group in (("dp", [1, 5]), ("pp", [5, 7]), ("tp", [4, 5])):
        assert f"<b>{name}</b> group {group}" in viewer.status.value
    assert viewer.view.frames != first
    viewer.sizes["tp"].value = 4  # a new shape: 16 rank buttons, back to rank 0
    assert list(viewer.ranks.options) == list(range(16)) and viewer.ranks.value == 0
    assert Mesh(dp=2, pp=2, tp=4).group_of("tp", 0) == [0, 1, 2, 3]
    assert "<b>tp</b> group [0, 1, 2, 3]" in viewer.status.value


def test_mesh_picture_says_what_each_rank_holds():
    from minipar.mesh import Mesh
    from minipar.widgets.mesh_view import holds, mesh_layout

    mesh = Mesh(dp=2, pp=2, tp=2)
    assert holds(mesh, 5, layers=8) == "layers 0-3\n2/2 of each matrix\nbatch part 2/2"
    assert holds(Mesh(dp=2, ep=4), 3, experts=8) == "experts 6-7\nbatch part 1/2"
    where = mesh_layout(mesh)
    assert where[0][1] == where[1][1] == where[2][1] > where[4][1]  # dp = rows
    assert where[0][0] < where[1][0] < where[2][0]  # tp side by side, then the next stage


def test_planner_explorer_ranks_what_fits_and_greys_out_when_nothing_does():
    from minipar.cost import OPT_CONFIGS
    from minipar.mesh.planner import plan
    from minipar.widgets import PlannerExplorer

    explorer = PlannerExplorer(model="13B", nodes=2, devices_per_node=8, memory_gb=80)
    best = plan(OPT_CONFIGS["13B"], explorer.cluster, 64)[0]
    assert explorer.plans[0] == best
    assert f"<b>Winner</b>: {best.label}" in explorer.status.value
    first = explorer.view.frames
    explorer.nic.value = 10  # a slow NIC changes the winner or at least its time
    assert explorer.plans[0].step > best.step and explorer.view.frames != first
    explorer.memory.value = 8
    explorer.model.value = "175B"
    explorer.nodes.value = 1
    assert explorer.plans == [] and "Nothing fits" in explorer.status.value
    assert "nothing fits" in explorer.view.greyed
    explorer.nodes.value = 64
    assert explorer.plans and explorer.view.greyed == ""


def test_ring_animator_steps_and_greys_an_invalid_choice():
    from minipar.widgets import RingAnimator

    animator = RingAnimator(ranks=4, causal=True, balanced=False)
    view = animator.view
    assert len(view.frames) == len(view.captions) == 4  # one frame per step, all sent
    assert "block that started on rank r - 2" in view.captions[2]
    assert len(set(view.frames)) == 4 and "step 2: what each rank holds" in view.frames[2]
    view.frame = 3
    animator.ranks.value = 2  # fewer steps: the frame shown follows
    assert len(view.frames) == 2 and view.frame == 1
    animator.causal.value = False
    animator.balanced.value = True
    assert "only helps causal attention" in animator.status.value
    assert "causal" in view.greyed and len(view.frames) == 2
    animator.causal.value = True
    assert view.greyed == "" and "balanced" in view.frames[0]


def test_ring_picture_refuses_what_it_cannot_draw():
    from minipar.widgets import render_ring

    with pytest.raises(ValueError, match="step must be in 0..3"):
        render_ring(4, 4)
    with pytest.raises(ValueError, match="world_size must be at most 8"):
        render_ring(9, 0)


def test_all_to_all_animator_walks_the_steps_of_each_kind():
    from minipar.widgets import AllToAllAnimator

    animator = AllToAllAnimator(layout="2 nodes x 4", kind="hierarchical")
    view = animator.view
    assert view.captions == ["before", "after step 1, inside nodes", "after step 2, across nodes"]
    assert len(set(view.frames)) == 3
    assert "up to 4 messages across nodes; the hierarchical one 1" in animator.status.value
    view.frame = 2
    animator.kind.value = "flat"  # one step only: the frame shown follows
    assert len(view.frames) == 2 and view.frame == 1
    counts = animator.counts()
    assert len(counts) == 8 and all(sum(row) == 8 for row in counts)
    with pytest.raises(ValueError, match="layout must be one of"):
        AllToAllAnimator(layout="5 x 5")


def test_exchange_picture_counts_links_inside_and_across_nodes():
    from minipar.widgets.exchange_view import _links, render_exchange

    sent = [[0, 2, 1, 0], [1, 0, 0, 3], [0, 0, 0, 1], [2, 0, 1, 0]]
    # inside: (0,1) (1,0) (2,3) (3,2); across: (0,2) (1,3) (3,0)
    assert _links(sent, 2) == (4, 5, 3, 6)
    with pytest.raises(ValueError, match="stage must be in 0..1 for flat"):
        render_exchange(sent, 2, 2, "flat", 2)


@pytest.mark.slow  # the widget runs ranks and kills one
def test_network_lab_runs_real_ranks_and_survives_a_kill():
    from minipar.slow_networks.lab import network_run
    from minipar.widgets import NetworkLab

    lab = NetworkLab("all-reduce", latency_ms=0.0, steps=4)
    assert lab.kill.disabled and "every step needs every rank" in lab.status.value
    lab.run()
    assert len(lab.view.frames) == 1 and "ms per step" in lab.status.value
    lab.method.value = "SWARM"
    assert not lab.kill.disabled
    lab.kill.value = "rank 3"
    result = lab.run()
    assert result["died"] is not None and result["died"][1] == 3
    assert len(result["losses"]) == 4 and "died at step" in lab.status.value
    assert len(lab.runs) == 2  # both runs on the plot, to compare
    with pytest.raises(ValueError, match="with a method other than 'all-reduce'"):
        network_run("all-reduce", kill=2)
    for method in ("SGP", "grouped pairs"):  # gossip goes on past a dead peer
        survived = network_run(method, steps=6, kill=2, kill_step=2)
        assert survived["died"] == (2, 2) and len(survived["losses"]) == 6, method
        assert survived["losses"][-1] < survived["losses"][0]


def test_exchange_strip_draws_both_exchanges_and_refuses_too_many_ranks():
    from matplotlib.colors import same_color

    from minipar.widgets import render_exchange_strip
    from minipar.widgets.exchange_view import PALETTE, routed_counts

    fig = render_exchange_strip(routed_counts(4, 4), 2, 2)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert len(titles) == 5 and titles[-1].startswith("hierarchical: after step 2")
    labels = fig.axes[0].get_xticklabels()  # the key: rank r's label in rank r's colour
    assert all(same_color(t.get_color(), PALETTE[r]) for r, t in enumerate(labels))
    with pytest.raises(ValueError, match="at most 12 ranks"):
        render_exchange_strip(routed_counts(16, 2), 4, 4)
