"""MASHA on a bilinear saddle point: uncompressed extragradient on ranks equals one process;
MASHA1 and MASHA2 reach a stated tolerance with fewer metered bytes than extragradient;
naive compressed extragradient stalls far from the saddle (Beznosikov et al. 2022, their
bilinear experiment); bad input is one line."""

import pytest
import torch
from conftest import value_errors

import minipar
from minipar.data_parallel.compression import RandK, TopK
from minipar.slow_networks.masha import compare, masha, solve
from minipar.slow_networks.saddle import (
    bilinear_problem,
    extragradient,
    extragradient_on_ranks,
    spiral,
)

TOLERANCE = 1e-4  # |z - z*| <= TOLERANCE x the start's distance counts as reached


def _extragradient_both_ways():
    problem = bilinear_problem(20, minipar.world_size())
    gamma = 0.5 / problem.lipschitz()
    run = extragradient_on_ranks(problem, gamma, 40)
    reference = extragradient(problem.operator, torch.zeros(problem.dim, dtype=torch.float64),
                              gamma, 40, problem.solution())
    return run.z, reference.z, run.distances, reference.distances, run.sent_bytes


def test_extragradient_on_ranks_equals_one_process(cluster2):
    for z, ref, distances, ref_distances, sent in cluster2.run(_extragradient_both_ways):
        # float64; the ring sums the ranks' F_m in another order than one process's mean
        assert (z - ref).abs().max() <= 1e-12
        assert distances == pytest.approx(ref_distances, abs=1e-12)
        assert distances[-1] < 1e-3 * distances[0]  # and it converges
        # 2 all-reduces per iteration, each 2(K-1)/K x 40 float64 entries on 2 ranks
        assert sent[-1] == 40 * 2 * 40 * 8


def _compressed_runs():
    problem = bilinear_problem(50, minipar.world_size())
    runs = compare(problem, 5, 0.1, ("extragradient", "masha1", "masha2", "rand-k", "top-k"),
                   {"extragradient": 50, "masha1": 350, "masha2": 350, "rand-k": 150,
                    "top-k": 150})
    return {r.method: (r.bytes_to_reach(TOLERANCE), r.distances) for r in runs}


@pytest.fixture(scope="module")
def compressed(cluster2):
    return cluster2.run(_compressed_runs)


@pytest.mark.slow  # optimizes to a tolerance on ranks
def test_masha_reaches_the_tolerance_with_fewer_bytes_than_extragradient(compressed):
    for runs in compressed:
        baseline = runs["extragradient"][0]
        assert baseline is not None
        for method in ("masha1", "masha2"):
            sent, _ = runs[method]
            assert sent is not None, f"{method} did not reach {TOLERANCE} x the start"
            assert sent < 0.9 * baseline, (method, sent, baseline)


def test_naive_compression_stalls_far_from_the_saddle(compressed):
    for runs in compressed:
        for method in ("rand-k", "top-k"):
            sent, distances = runs[method]
            assert sent is None
            # the second half of the run: a plateau (or worse), not a descent toward z*
            assert min(distances[len(distances) // 2:]) > 0.1 * distances[0], method


def test_gradient_descent_ascent_spirals_out_extragradient_in():
    radius = {m: spiral(m).norm(dim=1) for m in ("gda", "eg")}
    assert radius["gda"][-1] > 2 * radius["gda"][0]
    assert radius["eg"][-1] < 0.5 * radius["eg"][0]


def test_rand_k_is_unbiased_and_keeps_exactly_k():
    x = torch.arange(1.0, 11.0, dtype=torch.float64)
    comp = RandK.keeping(3, 10)
    draws = torch.stack([comp.round_trip(x) for _ in range(4000)])
    assert ((draws != 0).sum(1) == 3).all()
    assert torch.allclose(draws.mean(0), x, rtol=0.1)
    # 7/25 * 25 rounds up to 8 under ceil; keeping(7, 25) keeps 7
    assert (TopK.keeping(7, 25).round_trip(torch.arange(1.0, 26.0)) != 0).sum() == 7


def test_bad_input_is_one_line():
    problem = bilinear_problem(5, 1)
    messages = value_errors(
        lambda: masha(problem, "masha1", 0.1, 10, k=0),
        lambda: masha(problem, "masha2", 0.1, 10, k=11),
        lambda: masha(problem, "masha1", 0.1, 10, k=2, p=0),
        lambda: masha(problem, "masha1", 0.1, 10, k=2, p=1.5),
        lambda: masha(problem, "masha1", 0.0, 10, k=2),
        lambda: solve(problem, "extragradient", -1.0, 10),
        lambda: masha(problem, "masha1", 0.1, 10, k=2, tau=1.0),
        lambda: solve(problem, "sgd", 0.1, 10),
        lambda: bilinear_problem(5, 2, lam=0.0),
        lambda: extragradient_on_ranks(bilinear_problem(5, 3), 0.1, 10))
    for message, expected in zip(messages, ("k must be an int in 1..10", "k must be",
                                            "p must be in (0, 1]", "p must be in (0, 1]",
                                            "gamma must be a step size > 0", "gamma must",
                                            "tau must be in [0, 1)", "method must be one of",
                                            "lam must be > 0", "the problem has 3 parts"),
                                 strict=True):
        assert message.startswith(expected), message
        assert "\n" not in message
