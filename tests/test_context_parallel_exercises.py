"""Lesson 08's checks pass the right answers and name the usual mistakes."""

import pytest
import torch
import torch.distributed as dist

from minipar import collectives
from minipar.context_parallel import block_attention, merge
from minipar.context_parallel.exercises import check_merge, check_ring_step
from minipar.grading import ExerciseError

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


def merge_right(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (out_a * torch.exp(lse_a - safe)[..., None]
            + out_b * torch.exp(lse_b - safe)[..., None]), lse


def merge_by_exp(out_a, lse_a, out_b, lse_b):
    wa, wb = torch.exp(lse_a), torch.exp(lse_b)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], \
        torch.log(wa + wb)


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_max_lse(out_a, lse_a, out_b, lse_b):
    out, _ = merge_right(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def test_merge_check_accepts_the_right_answer():
    assert "equal to attention over all keys" in check_merge(merge_right)


@pytest.mark.parametrize("fn, words", [
    (merge_by_exp, "inf or nan"),
    (merge_average, "rescale it to the joint one"),
    (merge_max_lse, "lse is wrong"),
])
def test_merge_check_names_the_mistake(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_merge(fn)


def ring(q, kv, out, lse, *, forward=True, blocking=False, replace=False, keep=False):
    k, me = dist.get_world_size(), dist.get_rank()
    pos = torch.arange(q.shape[-2])
    o, lse_b = block_attention(q, kv[0], kv[1], pos, pos, causal=False)
    out, lse = (o, lse_b) if replace else merge(out, lse, o, lse_b)
    to, frm = ((me + 1) % k, (me - 1) % k) if forward else ((me - 1) % k, (me + 1) % k)
    incoming = torch.empty_like(kv)
    if blocking:
        collectives.send(kv, to)
        collectives.recv(incoming, frm)
    else:
        requests = [collectives.isend(kv, to), collectives.irecv(incoming, frm)]
        for r in requests:
            r.wait()
    return out, lse, kv if keep else incoming


def ring_right(q, kv, out, lse):
    return ring(q, kv, out, lse)


def ring_backwards(q, kv, out, lse):
    return ring(q, kv, out, lse, forward=False)


def ring_replacing(q, kv, out, lse):
    return ring(q, kv, out, lse, replace=True)


def ring_keeping(q, kv, out, lse):
    return ring(q, kv, out, lse, keep=True)


def ring_blocking(q, kv, out, lse):
    return ring(q, kv, out, lse, blocking=True)


def test_ring_step_check_accepts_the_right_answer():
    assert "every block went round" in check_ring_step(ring_right)


@pytest.mark.parametrize("fn, words", [
    (ring_backwards, "after step 0, rank 0 holds rank 1's block: send to rank r\\+1"),
    (ring_replacing, "rank 0's output after 2 steps differs.*do not replace"),
    (ring_keeping, "the block it already had"),
])
def test_ring_step_check_names_the_mistake(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_ring_step(fn, world_sizes=(2, 4) if fn is ring_backwards else (2,))


@pytest.mark.slow  # waits out the check's deadlock timeout
def test_ring_step_check_turns_a_deadlock_into_advice():
    with pytest.raises(ExerciseError, match="deadlock"):
        check_ring_step(ring_blocking, world_sizes=(2,), timeout=6)
