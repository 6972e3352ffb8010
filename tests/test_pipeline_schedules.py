"""Schedules as data: every generator validates; the simulator reproduces the bubble and
memory figures of the lecture; the validator catches broken schedules."""

import dataclasses

import pytest

from minipar.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    peak_in_flight,
    schedule,
    simulate,
    validate,
)

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # B = 2F, split evenly into I and W


def bubble(name, p, m, v=1, costs=UNIT):
    return simulate(schedule(name, p, m, v), costs).summary(p).bubble_fraction


def test_actions_print_like_torch_pipelining():
    assert str(Action(2, "F", 0)) == "2F0" and str(Action(1, "SEND_B", 3)) == "1SEND_B3"
    plan = schedule("1f1b", 2, 2)
    assert [str(a) for a in plan.actions[0]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1",
                                                 "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    assert str(plan).splitlines()[1] == "rank 1: 1F0 1B0 1F1 1B1"


def test_kinds_are_an_enum_that_prints_as_before():
    assert [str(k) for k in ActionKind] == ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B",
                                            "RECV_B"]
    assert Action(2, "F", 0) == Action(2, ActionKind.F, 0)  # the printed kind reads as the enum
    assert Action(2, "F", 0).kind is ActionKind.F and ActionKind.F == "F"
    with pytest.raises(ValueError):
        Action(0, "X", 0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_parse_reads_back_every_action_of_every_schedule(name):
    for p, m, v in [(1, 1, 1), (2, 4, 1), (3, 6, 1), (4, 8, 1), (2, 4, 2), (3, 6, 3), (4, 8, 2)]:
        if not SCHEDULES[name].fits(p, m, v):
            continue
        for actions in schedule(name, p, m, v).actions:
            for a in actions:
                assert Action.parse(str(a)) == a
                assert str(Action.parse(str(a))) == str(a)
    assert Action.parse("12SEND_B30") == Action(12, ActionKind.SEND_B, 30)
    for bad in ("F0", "2F", "2X0", "2F0 ", "-1F0"):
        with pytest.raises(ValueError, match="is not an action"):
            Action.parse(bad)


def test_each_family_owns_its_rules():
    assert SCHEDULES["interleaved_1f1b"].fits(4, 8, 2)
    assert not SCHEDULES["interleaved_1f1b"].fits(3, 8, 2)
    assert not SCHEDULES["naive"].fits(2, 2)
    assert not SCHEDULES["gpipe"].fits(2, 2, 2) and SCHEDULES["looped_bfs"].fits(2, 2, 2)
    assert [n for n, f in SCHEDULES.items() if f.takes_virtual] == [
        "interleaved_1f1b", "looped_bfs", "zb_v", "dualpipev"]
    assert [n for n, f in SCHEDULES.items() if f.split_backward] == ["zb_h1", "zb_v",
                                                                     "dualpipev"]
    assert not SCHEDULES["zb_v"].fits(2, 4, 3) and not SCHEDULES["dualpipev"].fits(2, 3, 2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(name):
    assert bubble(name, 4, 8) == pytest.approx(3 / 11)  # 0.2727
    for p, m in [(2, 1), (2, 8), (3, 5), (4, 4)]:
        assert bubble(name, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 8, 4)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    assert bubble("interleaved_1f1b", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_zb_h1_has_the_papers_bubble_with_1f1bs_peak_memory(p, m):
    # ZB-H1 (Qi et al. 2023): with F = I = W, each rank idles (p-1)(F+I-W) = p-1 units
    # instead of 1F1B's (p-1)(F+I+W), and no rank holds more micro-batches than 1F1B's rank 0
    assert bubble("zb_h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble("zb_h1", p, m) < bubble("1f1b", p, m)
    assert max(peak_in_flight(schedule("zb_h1", p, m))) == \
        max(peak_in_flight(schedule("1f1b", p, m))) == min(p, m)


def test_naive_split_gives_no_speedup():
    assert bubble("naive", 4, 1) == pytest.approx(3 / 4)


def test_peak_activations_gpipe_m_everywhere_1f1b_p_minus_rank():
    assert peak_in_flight(schedule("gpipe", 4, 8)) == [8, 8, 8, 8]
    assert peak_in_flight(schedule("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert peak_in_flight(schedule("looped_bfs", 2, 4, 2)) == [8, 8]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_validates_over_a_grid(name):
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 8):
            for v in ((1, 2, 3) if name in ("interleaved_1f1b", "looped_bfs") else
                      (2,) if SCHEDULES[name].placement == "v" else (1,)):
                if (name == "naive" and m != 1) or (name == "interleaved_1f1b" and m % p) \
                        or (SCHEDULES[name].placement == "v" and m < 2 * p):
                    continue
                plan = schedule(name, p, m, v)  # validates inside
                assert plan.stages == p * v


def test_simulated_makespan_and_p2p():
    plan = schedule("gpipe", 2, 2)
    assert simulate(plan, UNIT).makespan == pytest.approx(3 * 3)  # (m+p-1)(F+B)
    slow = simulate(plan, {**UNIT, "p2p": 0.5})
    assert slow.makespan == pytest.approx(9 + 2 * 0.5)  # one hop forward, one back
    with pytest.raises(ValueError, match="costs\\['F'\\] must be >= 0"):
        simulate(plan, {"F": -1.0})


def test_last_step_cuts_each_rank_on_its_own_clock():
    from minipar.pipeline.bench import last_step
    from minipar.trace import Timeline

    plan = schedule("gpipe", 2, 2)
    step = simulate(plan, UNIT)
    # two steps; rank 1's clock runs 2.5 units behind rank 0's (a late barrier exit), so
    # its last step's first F starts before rank 0's last "0F0"
    skew = {0: 0.0, 1: -2.5}
    events = [dataclasses.replace(e, start=e.start + s * 20 + skew[e.rank],
                                  end=e.end + s * 20 + skew[e.rank])
              for s in (0, 1) for e in step.events]
    last = last_step(Timeline(events), plan)
    assert sorted(e.label for e in last) == sorted(e.label for e in step.events)
    assert min(e.start for e in last.for_rank(1)) >= 20 - 2.5


def test_steps_of_cuts_every_step_so_each_round_has_its_own_costs():
    from minipar.pipeline.bench import steps_of
    from minipar.pipeline.simulate import costs_from_timeline
    from minipar.trace import Timeline

    plan = schedule("gpipe", 2, 2)
    step = simulate(plan, UNIT)
    skew = {0: 0.0, 1: -2.5}
    # three steps, the middle one twice as slow: each cut step keeps its own durations,
    # so a bound computed per round sees that round's F and B, not the last round's
    slow = {0: 1.0, 1: 2.0, 2: 1.0}
    events = [dataclasses.replace(e, start=e.start * slow[s] + s * 40 + skew[e.rank],
                                  end=e.end * slow[s] + s * 40 + skew[e.rank])
              for s in (0, 1, 2) for e in step.events]
    steps = steps_of(Timeline(events), plan)
    assert len(steps) == 3
    for got in steps:
        assert sorted(e.label for e in got) == sorted(e.label for e in step.events)
    ideal = [{k: v for k, v in costs_from_timeline(s, plan).items() if k in ("F", "B")}
             for s in steps]
    assert [simulate(plan, costs).makespan for costs in ideal] == \
        pytest.approx([step.makespan, 2 * step.makespan, step.makespan])


@pytest.mark.parametrize("args, words", [
    (("gpipe", 4, 8, 2), "virtual stages apply to"),
    (("interleaved_1f1b", 4, 6, 2), "microbatches must be a multiple of 4"),
    (("naive", 2, 4), "microbatches must be 1"),
    (("gpipe", 0, 4), "ranks must be an int >= 1"),
    (("wavefront", 2, 2), "name must be one of"),
])
def test_impossible_combinations_name_the_constraint(args, words):
    with pytest.raises(ValueError, match=words):
        schedule(*args)


def _broken(plan, rank, actions):
    copy = dataclasses.replace(plan, actions=[list(a) for a in plan.actions])
    copy.actions[rank] = actions
    return copy


def test_validate_catches_what_goes_wrong():
    plan = schedule("1f1b", 2, 2)
    r1 = plan.actions[1]
    with pytest.raises(ValueError, match="stage 1, micro-batch 0: expected F then B"):
        validate(_broken(plan, 1, [a for a in r1 if str(a) != "1B0"]))
    with pytest.raises(ValueError, match="must match in order"):
        swapped = [Action(1, "RECV_F", 1) if str(a) == "1RECV_F0" else
                   Action(1, "RECV_F", 0) if str(a) == "1RECV_F1" else a for a in r1]
        validate(_broken(plan, 1, swapped))
    with pytest.raises(ValueError, match="deadlock: rank 0 waits at 0RECV_B0"):
        r0 = plan.actions[0]  # rank 0 waits for a gradient before sending its activations
        validate(_broken(plan, 0, [r0[0], r0[2], r0[4], r0[1], r0[3], *r0[5:]]))
    with pytest.raises(ValueError, match="lives on rank 0"):
        validate(_broken(plan, 1, [Action(0, "F", 0), *r1]))


def test_in_flight_curve_and_bubble_filling():
    from minipar.pipeline import in_flight_over_time, simulate_bubble_work

    timeline = simulate(schedule("1f1b", 4, 8), UNIT)
    curves = in_flight_over_time(timeline)
    assert [max(h for _, h in curves[r]) for r in range(4)] == [4, 3, 2, 1]
    assert all(points[-1][1] == 0 for points in curves.values())
    before = timeline.summary(4).bubble_fraction
    filled = simulate_bubble_work(timeline, unit_cost=0.5)
    assert filled.summary(4).bubble_fraction < before / 2  # PipeFisher: idle time put to work
    assert len(filled.filter(kind="extra")) > 0
    with pytest.raises(ValueError, match="unit_cost must be > 0"):
        simulate_bubble_work(timeline, 0)
