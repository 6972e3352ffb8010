"""Lesson 11's checks pass the right answers and name the usual mistakes."""

import pytest
import torch
import torch.distributed as dist

from minipar.grading import ExerciseError
from minipar.train.exercises import check_global_grad_norm, check_overflow_skip
from minipar.train.optim import global_norm
from minipar.train.precision import LossScaler


def norm(grads, replicated, tp_group, pp_group, *, replicated_once=True, groups=("tp", "pp"),
         sqrt_first=False):
    first_tp_rank = dist.get_rank(tp_group) == 0
    total = torch.zeros(1, dtype=torch.float64)
    for g, rep in zip(grads, replicated, strict=True):
        if not rep or first_tp_rank or not replicated_once:
            total += g.double().pow(2).sum()
    if sqrt_first:
        total = total.sqrt()
    for name in groups:
        dist.all_reduce(total, group={"tp": tp_group, "pp": pp_group}[name])
    return total if sqrt_first else total.sqrt()  # a tensor: the check takes float() of it


def norm_right(grads, replicated, tp_group, pp_group):
    return norm(grads, replicated, tp_group, pp_group).item()


def norm_right_as_tensor(grads, replicated, tp_group, pp_group):
    return norm(grads, replicated, tp_group, pp_group)


def norm_counting_replicated_tp_times(grads, replicated, tp_group, pp_group):
    return norm(grads, replicated, tp_group, pp_group, replicated_once=False)


def norm_without_pp(grads, replicated, tp_group, pp_group):
    return norm(grads, replicated, tp_group, pp_group, groups=("tp",))


def norm_without_tp(grads, replicated, tp_group, pp_group):
    return norm(grads, replicated, tp_group, pp_group, groups=("pp",), replicated_once=False)


def norm_of_norms(grads, replicated, tp_group, pp_group):
    return norm(grads, replicated, tp_group, pp_group, sqrt_first=True)


def not_written(*args):
    raise NotImplementedError("exercise: not written")


def skip(grads, scale, *, agree=True, finite=torch.isfinite, op=dist.ReduceOp.MAX,
         skipping=True, halving=True):
    bad = any(not finite(g).all() for g in grads)
    flag = torch.tensor([float(bad)])
    if agree:
        dist.all_reduce(flag, op=op)
    overflow = flag.item() == 1  # with MAX, 1 means some rank overflowed
    return overflow and skipping, scale / 2 if overflow and halving else scale


def skip_right(grads, scale):
    return skip(grads, scale)


def skip_alone(grads, scale):
    return skip(grads, scale, agree=False)


def skip_on_inf_only(grads, scale):
    return skip(grads, scale, finite=lambda g: ~torch.isinf(g))


def skip_by_sum(grads, scale):
    return skip(grads, scale, op=dist.ReduceOp.SUM)


def halve_without_skipping(grads, scale):
    return skip(grads, scale, skipping=False)


def skip_without_halving(grads, scale):
    return skip(grads, scale, halving=False)


def test_right_answers_pass():
    assert check_global_grad_norm(norm_right).startswith("global_grad_norm: one process's")
    assert check_global_grad_norm(norm_right_as_tensor, layouts=((2, 2),))
    assert check_overflow_skip(skip_right).startswith("skip_on_overflow: on 2, 4 ranks")


@pytest.mark.parametrize("check, fn, words", [
    (check_global_grad_norm, norm_counting_replicated_tp_times,
     "rank 0 .*counted the replicated tensors .* tp times"),
    (check_global_grad_norm, norm_without_pp,
     "rank 0 .*only its own stage's part: all-reduce .* over pp_group"),
    (check_global_grad_norm, norm_without_tp,
     "rank 0 .*left out the other tp ranks' shards: all-reduce .* over tp_group"),
    (check_global_grad_norm, norm_of_norms, "rank 0 .*summed norms, not squares"),
    (check_overflow_skip, skip_alone, "an inf on rank 1 only: rank 1 skipped the step but "
                                      "rank 0 did not \\(only the ranks whose own"),
    (check_overflow_skip, skip_on_inf_only, "a nan on rank 0 only: no rank skipped: a nan is"),
    (check_overflow_skip, skip_by_sum, "an inf on every rank: .*compare the sum with > 0"),
    (check_overflow_skip, halve_without_skipping, "halved the scale but did not skip"),
    (check_overflow_skip, skip_without_halving, "ranks 0, 1 skipped but returned the scale 1024"),
    (check_global_grad_norm, global_norm, "the library's own implementation"),
    (check_overflow_skip, LossScaler(enabled=True).unscale_and_check,
     "the library's own implementation"),
    (check_global_grad_norm, not_written, "not written yet"),
    (check_overflow_skip, not_written, "not written yet"),
], ids=lambda v: getattr(v, "__name__", None))
def test_usual_mistakes_get_a_hint(check, fn, words):
    with pytest.raises(ExerciseError, match=words):
        check(fn)
