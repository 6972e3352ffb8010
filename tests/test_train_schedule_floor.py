"""A pipeline row's floor in the race against torch (issue 46): the schedule replayed with
each stage's traced median costs, messages free. Pure arithmetic: the fast tier runs it."""

import pytest

from minipar.pipeline import schedule, simulate
from minipar.trace import add_event
from minipar.train.torch_race import race_config, schedule_floor, stage_costs

STEPS = 3


def test_the_schedule_floor_is_1f1bs_critical_path():
    """p = 2, m = 4: the first stage's first forward, the last stage's four F + B, the
    first stage's last backward; with a heavier last stage, the last stage sets the pace."""
    config = race_config(dict(pp=2, microbatches=4), STEPS, preset="tiny")
    even = [dict(F={0: 1.0}, B={0: 2.0}), dict(F={1: 1.0}, B={1: 2.0})]
    assert schedule_floor(config, even) == pytest.approx(1 + 4 * 3 + 2)
    heavy_last = [dict(F={0: 1.0}, B={0: 2.0}), dict(F={1: 1.5}, B={1: 3.0})]
    assert schedule_floor(config, heavy_last) == pytest.approx(1 + 4 * 4.5 + 2)


def test_a_vs_floor_prices_each_of_a_ranks_two_stages():
    """On a V rank 0 runs stage 0 and stage 3: the traced medians come back per stage (not
    a message's wait), and the floor replays the two apart, the head's the heavier."""
    def step() -> None:  # rank 0's stage work as the engine records it, with set times
        for mb in range(2):
            add_event("F", f"0F{mb}", 0.0, 1.0, stage=0, microbatch=mb)
            add_event("F", f"3F{mb}", 0.0, 2.0 + mb, stage=3, microbatch=mb)
            add_event("recv", f"3RECV_F{mb}", 0.0, 9.0, stage=3, microbatch=mb)
    assert stage_costs(step, repeats=3) == {"F": {0: 1.0, 3: 2.5}}
    config = race_config(dict(pp=2, microbatches=4, schedule="zb_v", virtual=2), STEPS,
                         preset="tiny")
    even = [{k: {0: 1.0, 3: 1.0} for k in "FIW"}, {k: {1: 1.0, 2: 1.0} for k in "FIW"}]
    heavy_head = [{**even[0], "F": {0: 1.0, 3: 2.5}}, even[1]]
    plan = schedule("zb_v", 2, 4, 2)
    assert schedule_floor(config, even) == pytest.approx(simulate(plan, {}).makespan)
    floor = schedule_floor(config, heavy_head)  # the ranks' dicts merged, stage by stage
    assert floor == pytest.approx(simulate(plan, {"F": {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.5}}
                                           ).makespan)
    assert floor > schedule_floor(config, even)
