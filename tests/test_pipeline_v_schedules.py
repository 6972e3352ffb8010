"""V-shaped pipelines (ZB-V, DualPipeV): two stages per rank placed down and back, the
receives put in each sender's order, DualPipe's table derived by simulation, and the
activations the meter measures on real ranks. The engine's equality with one process
for both is in test_pipeline_engine.py (SYNC); with the trainer's tied weights, in
test_train_composed.py."""

import dataclasses
import itertools

import pytest
import torch

from minipar.pipeline import Action, Pipeline, peak_in_flight, schedule, simulate, split_model
from minipar.pipeline.plan import check_structure
from minipar.pipeline.v_schedules import dualpipe_table


@pytest.mark.parametrize("name", ["zb_v", "dualpipev"])
def test_a_v_goes_down_the_ranks_and_back_with_no_message_at_the_turn(name):
    plan = schedule(name, 3, 6, 2)
    assert [plan.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    sends = {(a.stage, a.kind.value) for acts in plan.actions for a in acts if a.kind.is_send}
    assert (2, "SEND_F") not in sends and (3, "SEND_B") not in sends  # stages 2, 3: rank 2
    assert (1, "SEND_F") in sends and (4, "SEND_B") in sends


def test_receives_follow_the_senders_order_whatever_they_carry():
    """In a V, rank 0 sends rank 1 activations and gradients out of step with the order
    rank 1 uses them; messages between two ranks match in posting order (NCCL ignores
    tags), so rank 1 receives them as sent and holds the early ones."""
    plan = schedule("zb_v", 2, 4, 2)
    rank1 = plan.actions[1]
    received = [a for a in rank1 if a.kind.is_recv]
    sent = [a for a in plan.actions[0] if a.kind.is_send]
    assert [(a.kind.carries, a.microbatch) for a in received] == \
        [(a.kind.carries, a.microbatch) for a in sent]
    # a receive ahead of the action that needs it: 1RECV_F2 comes before 2RECV_B0 is used
    first_b = rank1.index(Action(2, "I", 0))
    assert rank1.index(Action(1, "RECV_F", 2)) < first_b
    swapped = [list(acts) for acts in plan.actions]
    i, j = (swapped[1].index(a) for a in received[2:4])
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ValueError, match="must match in order"):
        check_structure(dataclasses.replace(plan, actions=swapped))


def test_dualpipe_table_reproduced_by_simulation():
    """DualPipe's README: bubble (PP-1)(F+B), (PP-1)(F+B-2W), (PP/2-1)(F&B+B-3W);
    parameters 1x, 1x, 2x; activations PP, PP, PP+1; over a grid of costs with F = I and
    W <= F, F&B from max(F, B) to F + B or not overlapped at all."""
    for pp, w, share in itertools.product((4, 8), (0.25, 0.6, 1.0), (0, 0.5, 1, None)):
        costs = {"F": 1.0, "B": 1.0 + w, "W": w}  # F = I = B - W
        if share is not None:  # F&B between the longer of the two and both in a row
            costs["F&B"] = costs["B"] + share * costs["F"]
        for m in (pp, 2 * pp + 1):
            rows = {r["method"]: r for r in dualpipe_table(pp, m, costs)}
            for row in rows.values():
                assert row["bubble"] == pytest.approx(row["formula_value"], abs=1e-9), \
                    (pp, m, costs, row)
            assert [rows[k]["activations_per_device"] for k in rows] == [pp, pp, pp + 1]
            assert [rows[k]["parameters_per_device"] for k in rows] == [1, 1, 2]
            assert [rows[k]["devices"] for k in rows] == [pp, pp, pp // 2]
    with pytest.raises(ValueError, match="an even number >= 4"):
        dualpipe_table(5, 10, {"F": 1, "B": 2, "W": 1})


def test_overlap_is_what_shortens_dualpipev_and_one_cpu_thread_has_none():
    plan = schedule("dualpipev", 4, 16, 2)
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    sequential = simulate(plan, costs).makespan
    assert simulate(plan, {**costs, "F&B": 3.0}).makespan == pytest.approx(sequential)
    overlapped = simulate(plan, {**costs, "F&B": 2.2}).makespan
    assert overlapped < sequential - len(plan.overlapped) / plan.ranks * 0.7
    assert all(f.kind.value == "F" and b.kind.value == "B" and f.stage != b.stage
               for f, b in plan.overlapped)


def test_a_stage_cost_dict_prices_each_of_a_ranks_two_stages():
    """A V's rank 0 holds stage 0 and stage 2p-1: costs given per stage price them apart;
    equal per-stage costs replay exactly as the same cost per rank."""
    plan = schedule("zb_v", 2, 4, 2)
    per_rank = {"F": [1.0, 1.0], "I": [1.0, 1.0], "W": [0.5, 0.5]}
    uniform = {kind: {s: v[0] for s in range(4)} for kind, v in per_rank.items()}
    assert simulate(plan, uniform).events == simulate(plan, per_rank).events
    heavy_head = {**uniform, "F": {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}}
    timeline = simulate(plan, heavy_head)
    forwards = {e.stage: e.duration for e in timeline.for_rank(0) if e.kind == "F"}
    assert forwards == {0: pytest.approx(1.0), 3: pytest.approx(3.0)}
    assert timeline.makespan > simulate(plan, uniform).makespan + 2
    with pytest.raises(ValueError, match="one entry per stage"):
        simulate(plan, {"F": {0: 1.0, 1: 1.0}})


def test_an_overlapped_pair_of_unequal_stages_still_takes_f_and_b_together():
    """DualPipeV's F&B chunk pairs one stage's F with another's B: with costs per stage,
    each half is scaled by F&B over its own pair's F + B, so every pair takes F&B."""
    plan = schedule("dualpipev", 4, 16, 2)
    stages = range(plan.stages)
    costs = {"F": {s: 1.0 + 0.25 * s for s in stages}, "B": {s: 2.0 + 0.5 * s for s in stages},
             "I": 1.0, "W": 1.0, "F&B": [2.5, 2.6, 2.7, 2.8]}
    took = {(e.rank, e.label): e.duration for e in simulate(plan, costs)}
    for f, b in plan.overlapped:
        r = plan.rank_of(f.stage)
        assert took[r, str(f)] + took[r, str(b)] == pytest.approx(costs["F&B"][r])
        assert took[r, str(f)] / took[r, str(b)] == pytest.approx(
            costs["F"][f.stage] / costs["B"][b.stage])


def test_zb_v_halves_zb_h1s_bubble_at_1f1bs_activation_memory():
    """The same model on p ranks: a V cuts it into 2p stages of half the cost each."""
    for p in (2, 3, 4):
        m = 4 * p
        h1 = simulate(schedule("zb_h1", p, m), {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})
        v = simulate(schedule("zb_v", p, m, 2), {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5})
        assert v.makespan < h1.makespan
        # 2p stage-units of half a stage's activations each: 1F1B's p whole ones
        assert max(peak_in_flight(schedule("zb_v", p, m, 2))) == 2 * p
        assert max(peak_in_flight(schedule("1f1b", p, m))) == p


def _v_activations(name, m):
    """Every (stage, micro-batch) saves the same bytes: its input and one hidden tensor
    (Linear, Tanh, Linear: the second Linear saves Tanh's output again, counted once), and
    the loss (a sum) saves nothing."""
    import minipar

    k = minipar.world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(2 * k)])
    pipe = Pipeline(split_model(model, 2 * k), schedule(name, k, m, 2), measure_activations=True)
    x = torch.randn(4 * m, 8)
    pipe.train_step(x, x, lambda out, _t: out.sum())
    return pipe.activations.peak, pipe.activations.now


@pytest.mark.parametrize("name", ["zb_v", "dualpipev"])
def test_the_meter_measures_the_activations_the_plan_holds(cluster2, name):
    unit = 2 * 4 * 8 * 4  # two tensors of a micro-batch's 4 x 8 float32
    runs = cluster2.run(_v_activations, name, 8)
    assert [peak / unit for peak, _ in runs] == peak_in_flight(schedule(name, 2, 8, 2))
    assert all(now == 0 for _, now in runs)
