"""Lesson 09's checks pass the right answers and name the usual mistakes."""

import pytest
import torch

from minipar.grading import ExerciseError
from minipar.moe.systems_exercises import check_partial_output, check_rows_for_peers


def peers_right(pieces, nodes, per_node):
    return [torch.cat([pieces[b * per_node + j] for b in range(nodes)]) for j in range(per_node)]


def peers_local_major(pieces, nodes, per_node):  # reads the layout as local-major
    return [torch.cat([pieces[j * nodes + b] for b in range(nodes)]) for j in range(per_node)]


def peers_reversed_nodes(pieces, nodes, per_node):
    return [torch.cat([pieces[b * per_node + j] for b in reversed(range(nodes))])
            for j in range(per_node)]


def test_rows_for_peers_accepts_the_right_answer():
    assert "equals the flat all-to-all" in check_rows_for_peers(peers_right)


@pytest.mark.parametrize("fn", [peers_local_major, peers_reversed_nodes])
def test_rows_for_peers_names_the_mistake(fn):
    with pytest.raises(ExerciseError, match="rows_for_peers.*rank \\d"):
        check_rows_for_peers(fn)


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
