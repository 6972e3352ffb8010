"""Lesson 10's push-sum check: the right answer passes, the usual mistakes get hints."""

import pytest
import torch

from minipar import collectives
from minipar.grading import ExerciseError
from minipar.slow_networks.exercises import check_push_sum
from minipar.slow_networks.gossip import push_sum as library_push_sum

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


def _exchange(message, peers, sources):
    incoming = [torch.empty_like(message) for _ in sources]
    pending = [collectives.irecv(b, s) for b, s in zip(incoming, sources, strict=True)]
    sends = [collectives.isend(message, d) for d in peers]
    total = message.clone()
    for request in pending:
        total += request.wait()
    for request in sends:
        request.wait()
    return total


def right(x, w, peers, sources):
    share = 1.0 / (len(peers) + 1)
    total = _exchange(torch.cat([x * share, x.new_tensor([w * share])]), peers, sources)
    return total[:-1], float(total[-1])


def no_weights(x, w, peers, sources):  # x mixes, w never travels
    share = 1.0 / (len(peers) + 1)
    return _exchange(x * share, peers, sources), w


def whole_copies(x, w, peers, sources):  # sends everything to everyone: mass grows
    total = _exchange(torch.cat([x, x.new_tensor([w])]), peers, sources)
    return total[:-1], float(total[-1])


def returns_ratio(x, w, peers, sources):
    x, w = right(x, w, peers, sources)
    return x / w


def test_the_right_push_sum_passes():
    assert "every rank reaches the average" in check_push_sum(right)


@pytest.mark.parametrize("wrong,words", [
    (no_weights, "w must travel with x"),
    (whole_copies, "must conserve both"),
    (returns_ratio, "return a tuple (x, w)"),
])
def test_usual_mistakes_get_hints(wrong, words):
    with pytest.raises(ExerciseError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_push_sum(wrong)


def test_the_library_is_refused():
    with pytest.raises(ExerciseError, match="library's own implementation"):
        check_push_sum(library_push_sum)
