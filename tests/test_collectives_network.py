"""The emulated network: every minipar send pays its link's latency + bytes / bandwidth
before it leaves, results unchanged; links by pair, both directions."""

import math

import pytest
import torch

from minipar import collectives, trace
from minipar.collectives import Link, slow_network
from minipar.collectives.network import active
from minipar.runtime import rank


def test_links_price_messages_both_ways():
    with slow_network(latency=1e-3, bandwidth=1e6, links={(0, 2): Link(0.5, 100.0)}) as net:
        assert active() is net
        assert net.seconds(0, 1, 1000) == pytest.approx(1e-3 + 1e-3)
        assert net.seconds(2, 0, 100) == pytest.approx(0.5 + 1.0)  # the pair, reversed
        assert (net.link(0, 2).alpha, net.link(0, 2).beta) == (0.5, 0.01)
    assert active() is None
    assert Link().seconds(10**9) == 0.0 and math.isinf(Link().bandwidth)


@pytest.mark.parametrize("bad", [dict(latency=-1.0), dict(bandwidth=0.0)])
def test_bad_links_say_what_to_change(bad):
    with pytest.raises(ValueError, match="latency >= 0 seconds and bandwidth > 0"):
        Link(**bad)
    with pytest.raises(ValueError, match="links must map"):
        with slow_network(links={(0, 1): 5.0}):
            pass


def _slowed():
    x = torch.full((256,), float(rank() + 1))
    with trace.capture() as fast:
        plain = collectives.all_reduce(x.clone())
    with slow_network(latency=0.02, links={(0, 1): Link(0.05)}), trace.capture() as slow:
        emulated = collectives.all_reduce(x.clone())
        if rank() == 0:
            pending = collectives.isend(torch.ones(4), 1)
            pending.wait()
        elif rank() == 1:
            collectives.recv(torch.zeros(4), 0)

    def sends(c, to):
        return [e.duration for e in c.events if e.kind == "send" and e.peer == to]

    peer = (rank() + 1) % 2
    return {"same": torch.equal(plain, emulated), "slow": sends(slow, peer),
            "fast": sends(fast, peer)}


def test_every_send_pays_its_link_and_results_do_not_change(cluster2):
    for r in cluster2.run(_slowed):
        assert r["same"]
        # the pair (0, 1) is the 50 ms link both ways: each message took at least that
        assert r["slow"] and min(r["slow"]) >= 0.05, r
        assert len(r["slow"]) >= len(r["fast"])


def test_nodes_slow_only_the_links_between_them():
    across = Link(0.5, 100.0)
    with slow_network(latency=1e-3, per_node=2, across=across, links={(1, 3): Link(7.0)}) as net:
        assert net.link(0, 1) == net.link(3, 2) == Link(1e-3)  # inside a node
        assert net.link(1, 2) == net.link(2, 0) == across  # between nodes 0-1 and 2-3
        assert net.link(3, 1) == Link(7.0)  # a pair named in links wins
        assert not net.crosses(2, 3) and net.crosses(0, 3)


@pytest.mark.parametrize("bad", [dict(per_node=2), dict(across=Link(1.0)),
                                 dict(per_node=0, across=Link(1.0)),
                                 dict(per_node=2, across=1.0)])
def test_bad_nodes_say_what_to_change(bad):
    with pytest.raises(ValueError, match="per_node") as err:
        with slow_network(**bad):
            pass
    assert "\n" not in str(err.value)
