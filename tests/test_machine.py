"""The fitted machine: its step schedules agree with the alpha-beta counts, its model is
the stated one, it is saved and loaded, and fitting it on real ranks gives sane figures."""

import pytest

from minipar.collectives import bench, fit_machine
from minipar.cost import CommStep, all_reduce_cost, all_reduce_steps
from minipar.machine import Machine
from minipar.pipeline import schedule, simulate
from minipar.report import ratio_cell

ALGORITHMS = ("naive", "tree", "ring", "halving_doubling")


CLOSED_FORMS = {  # (steps, bytes and additions on the critical path) for K ranks, N bytes
    "naive": lambda k, n: (2 * (k - 1), 2 * (k - 1) * n, (k - 1) * n),
    "tree": lambda k, n: (2 * (k - 1).bit_length(), 2 * (k - 1).bit_length() * n,
                          (k - 1).bit_length() * n),
    "ring": lambda k, n: (2 * (k - 1), 2 * (k - 1) * n / k, (k - 1) * n / k),
    "halving_doubling": lambda k, n: (
        2 * ((1 << (k.bit_length() - 1)).bit_length() - 1) + 2 * (k & (k - 1) != 0),
        2 * n * (1 - 1 / (1 << (k.bit_length() - 1))) + 2 * n * (k & (k - 1) != 0),
        n * (1 - 1 / (1 << (k.bit_length() - 1))) + n * (k & (k - 1) != 0)),
}


@pytest.mark.parametrize("k", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_steps_match_the_closed_forms(algorithm, k):
    """The one step schedule (which the machine and the alpha-beta model both price)
    takes the textbook's number of steps and puts its bytes and additions on the
    critical path; total traffic is 2(K-1)N for all but halving-doubling."""
    n = 1 << 20
    steps = all_reduce_steps(algorithm, k, n)
    count, critical, reduced = CLOSED_FORMS[algorithm](k, n)
    assert len(steps) == count
    assert sum(s.nbytes for s in steps) == pytest.approx(critical)
    assert sum(s.reduced for s in steps) == pytest.approx(reduced)
    assert all(1 <= s.transfers <= k and 2 <= s.ranks <= k for s in steps)
    priced = all_reduce_cost(algorithm, k, n, alpha=1.0, beta=1e-6, gamma=1e-9)
    assert priced.seconds == pytest.approx(count + critical * 1e-6 + reduced * 1e-9)
    if algorithm != "halving_doubling":
        assert priced.total_bytes == pytest.approx(2 * (k - 1) * n)


def test_ring_and_tree_keep_the_stated_concurrency():
    assert {s.transfers for s in all_reduce_steps("ring", 4, 8)} == {4}
    assert [s.transfers for s in all_reduce_steps("tree", 4, 8)] == [2, 1, 1, 2]
    assert {s.transfers for s in all_reduce_steps("naive", 4, 8)} == {1}


def test_step_price_is_linear_in_concurrent_transfers_between_the_two_measurements():
    m = Machine("gloo", alpha=1e-4, beta=1e-9, gamma=1e-10, cores=2, busy_ranks=4,
                busy_alpha=4e-4, busy_beta=4e-9)
    assert m.p2p_seconds(1000) == pytest.approx(1e-4 + 1e-6)
    assert m.step_seconds(CommStep(4, 1000, 4)) == pytest.approx(4e-4 + 4e-6)
    assert m.step_seconds(CommStep(2, 1000, 4)) == pytest.approx(2e-4 + 2e-6)
    # additions stretch by ranks / cores when ranks outnumber cores
    assert m.step_seconds(CommStep(1, 0, 4, reduced=1000)) == pytest.approx(1e-4 + 2e-7)
    unfitted = Machine("gloo", alpha=0.0, beta=1e-9, gamma=0.0, cores=2)
    assert unfitted.step_seconds(CommStep(4, 1000, 4)) == pytest.approx(4e-6)  # 2 cores each


def test_saved_and_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIPAR_MACHINE", str(tmp_path / "machine.json"))
    with pytest.raises(FileNotFoundError, match="minipar bench collectives"):
        Machine.load()
    m = Machine("gloo", 1e-4, 1e-9, 1e-10, 2, busy_ranks=2, busy_alpha=2e-4, busy_beta=3e-9)
    m.save()
    Machine("nccl", 1e-5, 1e-11, 0.0, 64).save()
    assert Machine.load("gloo") == m
    assert Machine.load("nccl").cores == 64


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="alpha"):
        Machine("gloo", -1.0, 0.0, 0.0, 2)
    with pytest.raises(ValueError, match="cores"):
        Machine("gloo", 0.0, 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="algorithm"):
        all_reduce_steps("star", 4, 8)


def test_fitted_on_real_ranks(cluster2):
    m = fit_machine(cluster2, save=False, sizes=[4, 64 << 10, 1 << 20, 4 << 20])
    assert m.backend == "gloo" and m.cores >= 1 and m.busy_ranks == 2
    assert 0 < m.alpha < 0.1 and 0 < m.beta < 1e-6 and 0 < m.gamma < 1e-6
    assert m.busy_alpha is not None and m.busy_beta is not None


def test_simulator_prices_messages_and_engine_overhead_per_rank():
    plan = schedule("1f1b", 2, 4)
    base = simulate(plan, {"F": 1.0, "B": 2.0})
    slower_last = simulate(plan, {"F": [1.0, 1.5], "B": [2.0, 2.5]})
    assert slower_last.makespan > base.makespan
    with_messages = simulate(plan, {"F": 1.0, "B": 2.0, "p2p": 0.25})
    # 1F1B on 2 stages: the critical path crosses between the ranks twice per micro-batch
    # at the start and end, so messages lengthen the step but less than one per action
    assert base.makespan < with_messages.makespan < base.makespan + 0.25 * len(plan.actions[0])
    overhead = simulate(plan, {"F": 1.0, "B": 2.0, "overhead": 0.01})
    assert overhead.makespan >= base.makespan + 0.01 * len(plan.actions[1]) - 1e-9
    with pytest.raises(ValueError, match="one per rank"):
        simulate(plan, {"F": [1.0, 1.0, 1.0]})
    with pytest.raises(ValueError, match=">= 0"):
        simulate(plan, {"overhead": -1.0})


def test_a_ratio_above_its_ceiling_is_called_noise():
    assert ratio_cell([1.2, 1.3, 1.4], ceiling=1.78) == "1.30x (1.20-1.40)"
    assert ratio_cell([1.7, 1.9, 2.1], ceiling=1.78).startswith("noise: 1.90x")


def test_the_collectives_bench_refits_only_once_its_fit_is_stale(monkeypatch):
    """Fitting before every size spent 28 of lesson 01's 34 s: a size reuses the last fit
    on its ranks until it is REFIT_AFTER_S old, and each row names the fit it was priced
    with (the report's spread counts each fit once)."""
    fits = []

    def fit(cluster, save):  # a machine per fit, told apart by its alpha
        fits.append((cluster.world_size, save))
        return Machine("gloo", alpha=len(fits) * 1e-4, beta=1e-9, gamma=1e-10, cores=2)

    class Ranks:  # the rule is the launcher's: ranks that answer at once, never started
        def __init__(self, k, backend):
            self.world_size = k

        def __enter__(self):
            return self

        def __exit__(self, *error):
            return False

        def run(self, task, algorithms, nbytes, rounds):  # every round 1 ms on every rank
            return [{a: [1e-3] * rounds for a in algorithms}] * self.world_size

    monkeypatch.setattr(bench, "Cluster", Ranks)
    monkeypatch.setattr(bench, "fit_machine", fit)
    for refit_after, expected in ((1e9, [(2, True)]), (0.0, [(2, True), (2, False)])):
        fits.clear()
        monkeypatch.setattr(bench, "REFIT_AFTER_S", refit_after)
        rows = bench.measure(world_sizes=(2,), sizes=[4 << 10, 8 << 10])
        assert fits == expected  # only the first fit of a K is saved for the other models
        by_size = {r["bytes"]: (r["fit"], r["alpha"]) for r in rows}
        assert len(set(by_size.values())) == len(expected), by_size
