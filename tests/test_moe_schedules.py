"""The MoE systems' schedules on a Timeline: the overlaps each one claims, from stated
costs."""

import pytest

from minipar.moe.system_timelines import SCHEMES, LayerCosts, schedule

COSTS = LayerCosts(experts=4.0, exchange=3.0, latency=0.0, load=5.0, in_node=2.0)


def test_plain_expert_parallelism_is_serial():
    assert schedule("ep", COSTS).makespan == pytest.approx(2 * 3.0 + 4.0)


def test_chunks_overlap_the_exchange_with_the_experts():
    one = schedule("pipelined", COSTS, chunks=1).makespan
    assert one == pytest.approx(schedule("ep", COSTS).makespan)  # one chunk: nothing overlaps
    four = schedule("pipelined", COSTS, chunks=4).makespan
    assert four < one
    # at least the network's own time: it carries every byte either way
    assert four >= 2 * 3.0
    # a latency per message makes many chunks lose again
    slow = LayerCosts(experts=4.0, exchange=3.0, latency=1.0)
    assert schedule("pipelined", slow, chunks=16).makespan > schedule("ep", slow).makespan


def test_prefetch_hides_the_copies_behind_the_layer_before():
    serial = schedule("load, then run", COSTS, layers=3)
    assert serial.makespan == pytest.approx(3 * (5.0 + 2 * 3.0 + 4.0))
    ahead = schedule("prefetch", COSTS, layers=3)
    assert ahead.makespan < serial.makespan
    copies = [e for e in ahead if e.label.startswith("load")]
    layer0 = [e for e in ahead if e.label.startswith("L0 ")]
    assert copies[1].start < max(e.end for e in layer0)  # load 1 runs during layer 0


def test_parm_sends_a_share_and_overlaps_inside_with_across():
    plain, parm = schedule("tp x ep", COSTS, tp=2), schedule("parm", COSTS, tp=2, chunks=4)
    network = lambda t: sum(e.duration for e in t if e.kind == "all_to_all")  # noqa: E731
    assert network(parm) == pytest.approx(network(plain) / 2)
    assert parm.makespan < plain.makespan


def test_bad_scheme_and_sizes():
    with pytest.raises(ValueError, match="scheme must be one of"):
        schedule("fast", COSTS)
    with pytest.raises(ValueError, match="chunks, layers and tp must be >= 1"):
        schedule("pipelined", COSTS, chunks=0)
    assert len(SCHEMES) == 6
