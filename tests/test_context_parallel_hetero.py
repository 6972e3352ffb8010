"""Heterogeneity-adaptive sequence placement: balanced beats even, and the gradient is the
same sum whichever rank computes which sequence."""

import pytest
import torch

from minipar.context_parallel.hetero import (
    assign_balanced,
    assign_even,
    predicted_step,
    run_assignment,
    variable_lengths,
)

LENGTHS = [12, 40, 8, 64, 16, 24, 8, 32]


def test_balanced_placement_finishes_sooner_than_even_on_uneven_ranks():
    lengths = variable_lengths(32, seed=3)
    speeds = [1.0, 1.0, 0.5, 0.5]
    even, balanced = assign_even(lengths, 4), assign_balanced(lengths, speeds)
    assert sorted(i for seqs in balanced for i in seqs) == list(range(32))
    assert predicted_step(balanced, lengths, speeds) < 0.8 * predicted_step(even, lengths,
                                                                            speeds)
    loads = [sum(lengths[i] for i in seqs) for seqs in balanced]
    assert loads[0] > loads[2] and loads[1] > loads[3]  # fast ranks take more


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="speeds must be positive"):
        assign_balanced([4, 8], [1.0, 0.0])
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        assign_even([4], 0)


def test_every_placement_gives_the_one_process_gradient(cluster2):
    speeds = [1.0, 0.5]
    (_, one), = [run_assignment([list(range(len(LENGTHS)))], LENGTHS, [1.0], hidden=16,
                                dtype=torch.float64)]
    for assignment in (assign_even(LENGTHS, 2), assign_balanced(LENGTHS, speeds)):
        for _, summed in cluster2.run(run_assignment, assignment, LENGTHS, speeds, 16,
                                      0, torch.float64):
            assert torch.allclose(summed, one, rtol=1e-10)
