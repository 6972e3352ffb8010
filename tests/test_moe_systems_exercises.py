"""Lesson 09's checks pass the right answers and name the usual mistakes."""

import pytest
import torch

from minipar.grading import ExerciseError
from minipar.moe.systems_exercises import check_partial_output, check_uneven_dispatch

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


def dispatch(rows, counts, *, exchange=True, source_order=True):
    import torch.distributed as dist

    k = dist.get_world_size()
    incoming = torch.tensor(counts)  # a guess: what this rank sends, not what it gets
    if exchange:
        incoming = torch.empty(k, dtype=torch.int64)
        dist.all_to_all_single(incoming, torch.tensor(counts))
    out = rows.new_empty(int(incoming.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows, incoming.tolist(), list(counts))
    if not source_order:  # the right rows, sorted by their index within each piece
        out = out[torch.argsort(out[:, 1], stable=True)]
    return out


def dispatch_right(rows, counts):
    return dispatch(rows, counts)


def dispatch_guessing_counts(rows, counts):
    return dispatch(rows, counts, exchange=False)


def dispatch_out_of_order(rows, counts):
    return dispatch(rows, counts, source_order=False)


def dispatch_a_list(rows, counts):
    return dispatch(rows, counts).tolist()


@pytest.mark.slow  # the check starts its own ranks
def test_uneven_dispatch_accepts_the_right_answer():
    assert "in source order, on 3, 4 ranks" in check_uneven_dispatch(dispatch_right)


@pytest.mark.parametrize("fn, words", [
    (dispatch_guessing_counts, "uneven_dispatch: rank \\d crashed: .*exchange the counts first"),
    (dispatch_out_of_order, "rank \\d received the right rows in the wrong order"),
    (dispatch_a_list, "rank 0 returned a list; return the received rows as a tensor"),
])
@pytest.mark.slow  # the check starts its own ranks, once per mistake
def test_uneven_dispatch_names_the_mistake(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_uneven_dispatch(fn)


def partial(x, expert, weight, kept, experts, first, *, weighted=True, only_kept=True):
    out = x.new_zeros(x.shape)
    for i, module in enumerate(experts):
        chosen = expert == first + i
        token, choice = torch.nonzero(chosen & kept if only_kept else chosen, as_tuple=True)
        w = weight[token, choice].unsqueeze(-1) if weighted else 1.0
        out = out.index_add(0, token, module(x[token]) * w)
    return out


def partial_right(x, expert, weight, kept, experts, first):
    return partial(x, expert, weight, kept, experts, first)


def partial_unweighted(x, expert, weight, kept, experts, first):
    return partial(x, expert, weight, kept, experts, first, weighted=False)


def partial_global_index(x, expert, weight, kept, experts, first):
    return partial(x, expert, weight, kept, experts, 0)


def test_partial_output_accepts_the_right_answer():
    assert "equals the layer" in check_partial_output(partial_right)


@pytest.mark.parametrize("fn, words", [
    (partial_unweighted, "rank 0's partial output \\(experts 0..1\\).*gate weight"),
    (partial_global_index, "on 2 ranks: rank 1's partial.*\\(expert == first \\+ i\\) & kept"),
])
def test_partial_output_names_the_mistake(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_partial_output(fn)
