"""Lesson 06's checks pass the right answers and name the usual mistakes."""

import pytest
import torch
import torch.distributed as dist

from minipar import collectives
from minipar.grading import ExerciseError
from minipar.sharded.exercises import check_fsdp_forward, check_zero1_step
from minipar.sharded.fsdp import FullyShardedDataParallel

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


def zero1(flat, grad, momentum, lr, beta, *, reduce="reduce_scatter", op="avg", gather=True):
    k, me = dist.get_world_size(), dist.get_rank()
    n = flat.numel() // k
    if reduce == "reduce_scatter":
        mine = collectives.reduce_scatter(grad, op=op)
    else:
        mine = collectives.all_reduce(grad.clone(), op=op)[me * n:(me + 1) * n]
    momentum.mul_(beta).add_(mine)
    updated = flat[me * n:(me + 1) * n] - lr * momentum
    if gather:
        flat.copy_(collectives.all_gather(updated))
    else:
        flat[me * n:(me + 1) * n] = updated


def zero1_right(flat, grad, momentum, lr, beta):
    zero1(flat, grad, momentum, lr, beta)


def zero1_without_gather(flat, grad, momentum, lr, beta):
    zero1(flat, grad, momentum, lr, beta, gather=False)


def zero1_summing(flat, grad, momentum, lr, beta):
    zero1(flat, grad, momentum, lr, beta, op="sum")


def zero1_all_reduce(flat, grad, momentum, lr, beta):
    zero1(flat, grad, momentum, lr, beta, reduce="all_reduce")


def fsdp(unit, shard, x, *, free="storage", bias_first=False):
    full = collectives.all_gather(shard)
    if bias_first:
        unit.bias.data, unit.weight.data = full[:3], full[3:18].view(3, 5)
    else:
        unit.weight.data, unit.bias.data = full[:15].view(3, 5), full[15:18]
    y = unit(x)
    if free == "storage":  # what fsdp.py does: autograd's saved view goes empty too
        for p in unit.parameters():
            p.untyped_storage().resize_(0)
    elif free == "data":  # repoints the parameters; autograd's saved view keeps the bytes
        for p in unit.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
    return y


def fsdp_right(unit, shard, x):
    return fsdp(unit, shard, x)


def fsdp_keeping_parameters(unit, shard, x):
    return fsdp(unit, shard, x, free=None)


def fsdp_repointing_data(unit, shard, x):
    return fsdp(unit, shard, x, free="data")


def fsdp_bias_first(unit, shard, x):
    return fsdp(unit, shard, x, bias_first=True)


def fsdp_without_gathering(unit, shard, x):
    return unit(x)


@pytest.mark.slow  # the checks start their own ranks
def test_right_answers_pass():
    assert check_zero1_step(zero1_right).startswith("zero1_step: one process's")
    assert check_fsdp_forward(fsdp_right).startswith("fsdp_forward: gather, compute, free")


@pytest.mark.parametrize("check, fn, words", [
    (check_zero1_step, zero1_without_gather, "rank 0, step 0: only this rank's slice"),
    (check_zero1_step, zero1_summing, "rank 0, step 0: slices \\[0, 1\\] .*op='avg'"),
    (check_zero1_step, zero1_all_reduce, "right numbers, but with an all-reduce"),
    (check_fsdp_forward, fsdp_keeping_parameters, "rank 0: the parameters still hold 18 numbers"),
    (check_fsdp_forward, fsdp_repointing_data, "rank 0: .*autograd saved .* holds 18 numbers"),
    (check_fsdp_forward, fsdp_bias_first, "the weight \\(15 numbers"),
    (check_fsdp_forward, fsdp_without_gathering, "rank \\d called the unit while its param"),
    (check_zero1_step, FullyShardedDataParallel, "the library's own implementation"),
], ids=["no-gather", "sum", "all-reduce", "no-free", "data-only", "bias-first", "no-gather-fsdp",
     "library"])
@pytest.mark.slow  # the checks start their own ranks, once per mistake
def test_usual_mistakes_get_a_hint(check, fn, words):
    with pytest.raises(ExerciseError, match=words):
        check(fn)
