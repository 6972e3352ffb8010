"""The NCCL rehearsal (issue 69): minipar's own messages, logged on gloo ranks, replay to
completion under NCCL's rules in both modes, and each deadlock the GPU audit found is
reported, with its pattern, when its code is put back."""

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import collectives as C
from minipar import nccl_rehearsal
from minipar.collectives.message_log import Entry, LoggedMessage, recording
from minipar.collectives.nccl_replay import replay
from minipar.pipeline import schedule
from minipar.pipeline.message_plan import _logs, gaps, message_batches
from minipar.runtime.device import FAKED_ENV
from minipar.train.loop import SYNCHRONOUS


@pytest.fixture(scope="module")
def cluster3():
    with minipar.Cluster(3, backend="gloo", timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def clusters(cluster2, cluster3, cluster4):
    made = {}

    def get(k):
        shared = {2: cluster2, 3: cluster3, 4: cluster4}
        if k in shared:
            return shared[k]
        if k not in made:
            made[k] = minipar.Cluster(k, backend="gloo", timeout=60)
        return made[k]

    yield get
    for c in made.values():
        c.close()


def _rehearse(clusters, slow: bool, monkeypatch) -> list:
    # on the faked device as well: both rehearsals in one run (runtime/faked_device.py)
    monkeypatch.setenv(FAKED_ENV, "1")
    chosen = [c for c in nccl_rehearsal.cases() if c.slow == slow]
    rows = nccl_rehearsal.rehearse(chosen, clusters)
    assert all(row.completes for row in rows), nccl_rehearsal.table(rows)
    return rows


def test_every_fast_case_completes_under_both_modes(clusters, monkeypatch):
    rows = _rehearse(clusters, False, monkeypatch)
    names = " ".join(row.case for row in rows)
    for needed in ("pp2 dualpipev", "pp4 zb_v", "cp2 ulysses", "ring attention, 3",
                   "MoE exchange", "reshard", "dp2 x cp2", "tp overlap, 3", "ep2"):
        assert needed in names


@pytest.mark.slow
def test_every_slow_case_completes_under_both_modes(clusters, monkeypatch):
    names = " ".join(row.case for row in _rehearse(clusters, True, monkeypatch))
    assert "K=8" in names and "pp4 looped_bfs" in names


# --------------------------------------------- the audit's deadlocks, put back ---

def _old_ring():
    """ring.py before the fix: isend then irecv, each posted on its own."""
    k, me = minipar.world_size(), minipar.rank()
    x, into = torch.ones(4), torch.empty(4)
    with recording() as log:
        requests = [dist.isend(x, (me + 1) % k), dist.irecv(into, (me - 1) % k)]
        for r in requests:
            r.wait()
    return log.entries


def _old_tied_sum():
    """mesh/model.py's sum_tied_gradients before the fix: an isend on its own, then a
    batched recv (finding 2)."""
    me = minipar.rank()
    grad, theirs = torch.ones(4), torch.empty(4)
    with recording() as log:
        pending = dist.isend(grad, 1 - me)
        C.recv(theirs, 1 - me)
        pending.wait()
    return log.entries


def _crossing():
    """Two ranks each post a send, then the receive that matches the other's send, as
    two batches: the 1F1B F1/B0 crossing (finding 4)."""
    me = minipar.rank()
    x, into = torch.ones(4), torch.empty(4)
    with recording() as log:
        send = C.isend(x, 1 - me)
        C.irecv(into, 1 - me).wait()
        send.wait()
    return log.entries


def _fixed_ring():
    k, me = minipar.world_size(), minipar.rank()
    with recording() as log:
        C.sendrecv(torch.ones(4), (me + 1) % k, torch.empty(4), (me - 1) % k)
    return log.entries


def test_the_send_first_ring_is_a_creation_cycle_and_its_fix_completes(cluster3):
    logs = list(cluster3.run(_old_ring))
    lazy, eager = replay(logs, "lazy"), replay(logs, "eager")
    assert lazy.pattern == "communicator creation cycle", lazy
    assert len(lazy.lines) == 3 and all("making the pair communicator" in x for x in lazy.lines)
    assert eager.pattern == "crossing", eager
    fixed = list(cluster3.run(_fixed_ring))
    assert replay(fixed, "lazy").completes and replay(fixed, "eager").completes


def test_an_unbatched_send_never_meets_a_batched_receive(cluster2):
    logs = list(cluster2.run(_old_tied_sum))
    lazy = replay(logs, "lazy")
    assert lazy.pattern == "different communicators" and lazy.mismatched == 2, lazy
    # the lines that posted each end (this module's functions reach ranks as dynamic code)
    assert "sends at <dynamic-code>:" in lazy.lines[0] and "pair communicator" in lazy.lines[0]
    # with device_id both go on the group's communicator, and then they cross instead
    assert replay(logs, "eager").pattern == "crossing"


def test_a_send_queued_before_the_receive_it_waits_for_is_a_crossing(cluster2):
    outcome = replay(list(cluster2.run(_crossing)), "eager")
    assert outcome.pattern == "crossing" and len(outcome.crossed) == 2, outcome
    assert "queued behind rank 1's" in outcome.lines[0]


def _trainer_with_the_old_tied_sum(monkeypatch_old: bool):
    """Put the old sum_tied_gradients back in the library and log a pp2 trainer run."""
    from minipar.mesh import model

    if monkeypatch_old:
        def old_sendrecv(tensor, dst, into, src, group=None, label=None, **fields):
            peer = dist.get_global_rank(group, dst)
            pending = dist.isend(tensor, peer, group)
            C.recv(into, src, group)
            pending.wait()
            return into

        model.collectives = type("patched", (), {"sendrecv": staticmethod(old_sendrecv)})
    try:
        return nccl_rehearsal.recorded(nccl_rehearsal.trainer, {"pp": 2, "microbatches": 2},
                                       {"layers": 2, "tied": True})
    finally:
        model.collectives = C


def test_the_trainers_old_tied_sum_is_caught_in_a_real_run(cluster2):
    logs = list(cluster2.run(_trainer_with_the_old_tied_sum, True))
    lazy = replay(logs, "lazy")
    assert lazy.pattern == "different communicators", lazy
    # 3 steps (2, the evaluation having none, and the memory step) x 2 ranks
    assert lazy.mismatched == 6 and "on its pair communicator" in lazy.lines[0], lazy


# --------------------------------------------------- the pipeline's batches ---

V = {"interleaved_1f1b": 2, "looped_bfs": 2, "zb_v": 2, "dualpipev": 2}


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_every_synchronous_schedule_gets_batches_nccl_completes(name):
    for ranks in (2, 3, 4):
        v = V.get(name, 1)
        plan = schedule(name, ranks, 1 if name == "naive" else 2 * ranks * v, v)
        batches = message_batches(plan)
        assert batches is not None, (name, ranks)
        for shapes_known in (False, True):
            assert replay(_logs(plan, plan.actions, batches, shapes_known), "eager").completes
        # nothing lost or doubled: each rank posts each of its messages once
        for r, mine in enumerate(plan.actions):
            posted = sorted(str(a) for batch in batches[r].values() for a in batch)
            assert posted == sorted(str(a) for a in mine if not a.is_compute)


def test_the_plans_own_gaps_cross_on_zb_v_and_looped_schedules():
    plan = schedule("zb_v", 2, 4, 2)
    plain = replay(_logs(plan, plan.actions, [gaps(a) for a in plan.actions], True), "eager")
    assert plain.pattern == "crossing", plain
    plan = schedule("1f1b", 4, 8)
    assert replay(_logs(plan, plan.actions, [gaps(a) for a in plan.actions], True),
                  "eager").completes


# ---------------------------------------------------------- the replay's rules ---

def _post(where, peer, direction, batched=True, group=(0, 1)):
    return Entry("post", "main", where, group=group,
                 messages=(LoggedMessage(direction, peer, 8),), batched=batched)


def test_wait_does_not_block_the_host_but_a_sync_does():
    # rank 0 waits for its receive, then sends what rank 1 waits for: under NCCL the wait
    # only orders the stream, so the send is posted and both complete
    logs = [[_post("r0", 1, "recv"), Entry("wait", "main", "", request=0), _post("s0", 1, "send")],
            [_post("r1", 0, "recv"), Entry("wait", "main", "", request=0), _post("s1", 0, "send")]]
    stuck = replay(logs, "eager")
    # the second posts are queued behind the first on one stream: still a crossing...
    assert stuck.pattern == "crossing"
    # ... while with a host sync after the wait, the host never posts the send at all
    synced = [[*log[:2], Entry("sync", "main", "item", name="item"), log[2]] for log in logs]
    assert replay(synced, "eager").pattern == "deadlock"
    together = [[Entry("post", "main", "x", group=(0, 1),
                       messages=(LoggedMessage("recv", 1 - r, 8), LoggedMessage("send", 1 - r, 8)))]
                for r in range(2)]
    assert replay(together, "eager").completes


def test_a_collective_needs_every_member_and_a_signal_blocks_only_its_waiter():
    coll = Entry("collective", "main", "c", group=(0, 1, 2), name="all_reduce")
    assert replay([[coll], [coll], [coll]], "lazy").completes
    missing = replay([[coll], [coll], []], "eager")
    assert not missing.completes and "waits for a member" in missing.lines[0]
    awaited = [[Entry("await", "main", "a", name="k")], [Entry("publish", "main", "p", name="k")]]
    assert replay(awaited, "eager").completes
    never = replay([[Entry("await", "main", "a", name="k")], []], "eager")
    assert not never.completes and "to be published" in never.lines[0]


def _recv_any_as_if_nccl():
    original = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        C.recv_any(torch.zeros(2))
    except ValueError as err:
        return str(err)
    finally:
        dist.get_backend = original
    return "no error"


def test_what_only_gloo_can_do_refuses_nccl_in_one_line(cluster2, monkeypatch):
    assert "recv_any needs backend='gloo'" in cluster2.run(_recv_any_as_if_nccl)[0]
    # surviving a dead peer reads gloo's errors: refused before any process starts
    monkeypatch.setattr(minipar.runtime.cluster, "resolve_backend", lambda b, n: "nccl")
    with pytest.raises(ValueError, match="tolerate_deaths needs backend='gloo'"):
        minipar.launch(abs, 2, 1, tolerate_deaths=True)
