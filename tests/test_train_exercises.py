"""Lesson 11's checks pass the right answers and name the usual mistakes."""

import pytest
import torch
import torch.distributed as dist

from minipar.grading import ExerciseError
from minipar.train.exercises import check_global_grad_norm, check_loss_scale
from minipar.train.optim import global_norm
from minipar.train.precision import LossScaler

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


def norm(grads, replicated, tied, tp_group, pp_group, *, replicated_once=True,
         groups=("tp", "pp"), sqrt_first=False, tied_ends="first", tied_tp_once=True):
    first_tp_rank = dist.get_rank(tp_group) == 0
    first_stage = dist.get_rank(pp_group) == 0
    total = torch.zeros(1, dtype=torch.float64)
    for g, rep, tie in zip(grads, replicated, tied, strict=True):
        if tie:
            counted = {"first": first_stage, "both": True, "none": False}[tied_ends]
            if counted and (first_tp_rank or not tied_tp_once or not replicated_once):
                total += g.double().pow(2).sum()
        elif not rep or first_tp_rank or not replicated_once:
            total += g.double().pow(2).sum()
    if sqrt_first:
        total = total.sqrt()
    for name in groups:
        dist.all_reduce(total, group={"tp": tp_group, "pp": pp_group}[name])
    return total if sqrt_first else total.sqrt()  # a tensor: the check takes float() of it


def norm_right(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group).item()


def norm_right_as_tensor(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group)


def norm_right_on_last_stage(grads, replicated, tied, tp_group, pp_group):
    """The tied embedding counted on the last stage instead of the first: the same norm."""
    last = dist.get_rank(pp_group) == dist.get_world_size(pp_group) - 1
    kept = [(g, r) for g, r, t in zip(grads, replicated, tied, strict=True) if not t or last]
    return norm([g for g, _ in kept], [r for _, r in kept], [False] * len(kept), tp_group,
                pp_group).item()


def norm_counting_replicated_tp_times(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, replicated_once=False)


def norm_without_pp(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, groups=("tp",))


def norm_without_tp(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, groups=("pp",),
                replicated_once=False)


def norm_of_norms(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, sqrt_first=True)


def norm_counting_tied_twice(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, tied_ends="both")


def norm_leaving_out_tied(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, tied_ends="none")


def norm_counting_tied_tp_times(grads, replicated, tied, tp_group, pp_group):
    return norm(grads, replicated, tied, tp_group, pp_group, tied_tp_once=False)


def not_written(*args):
    raise NotImplementedError("exercise: not written")


def scale_rule(grads, scale, clean, interval, *, agree=True, finite=torch.isfinite,
               op=dist.ReduceOp.MAX, skipping=True, halving=True, growing=True,
               reset_on_grow=True, reset_on_overflow=True, grow_every_step=False):
    bad = any(not finite(g).all() for g in grads)
    flag = torch.tensor([float(bad)])
    if agree:
        dist.all_reduce(flag, op=op)
    overflow = flag.item() == 1  # with MAX, 1 means some rank overflowed
    if overflow:
        return skipping, scale / 2 if halving else scale, 0 if reset_on_overflow else clean
    if growing and (grow_every_step or clean + 1 == interval):
        return False, scale * 2, 0 if reset_on_grow else clean + 1
    return False, scale, clean + 1


def scale_right(grads, scale, clean, interval):
    return scale_rule(grads, scale, clean, interval)


def variant(name, **wrong):
    def fn(grads, scale, clean, interval):
        return scale_rule(grads, scale, clean, interval, **wrong)
    fn.__name__ = name
    return fn


skip_alone = variant("skip_alone", agree=False)
skip_on_inf_only = variant("skip_on_inf_only", finite=lambda g: ~torch.isinf(g))
skip_by_sum = variant("skip_by_sum", op=dist.ReduceOp.SUM)
halve_without_skipping = variant("halve_without_skipping", skipping=False)
skip_without_halving = variant("skip_without_halving", halving=False)
never_grows = variant("never_grows", growing=False)
grows_without_reset = variant("grows_without_reset", reset_on_grow=False)
counts_through_overflow = variant("counts_through_overflow", reset_on_overflow=False)
grows_every_step = variant("grows_every_step", grow_every_step=True)


@pytest.mark.slow  # the checks start their own ranks
def test_right_answers_pass():
    assert check_global_grad_norm(norm_right).startswith("global_grad_norm: one process's")
    assert check_global_grad_norm(norm_right_as_tensor, layouts=((2, 2),))
    assert check_global_grad_norm(norm_right_on_last_stage, layouts=((2, 2), (1, 2)))
    assert check_loss_scale(scale_right).startswith("update_loss_scale: on 2, 4 ranks")


@pytest.mark.parametrize("check, fn, words", [
    (check_global_grad_norm, norm_counting_replicated_tp_times,
     "rank 0 .*counted the replicated tensors .* tp times"),
    (check_global_grad_norm, norm_without_pp,
     "rank 0 .*only its own stage's part: all-reduce .* over pp_group"),
    (check_global_grad_norm, norm_without_tp,
     "rank 0 .*left out the other tp ranks' shards: all-reduce .* over tp_group"),
    (check_global_grad_norm, norm_of_norms, "rank 0 .*summed norms, not squares"),
    (check_global_grad_norm, norm_counting_tied_twice,
     "tp=2 x pp=2, rank 0 .*counted the tied embedding .* on both ends of the pipeline"),
    (check_global_grad_norm, norm_leaving_out_tied, "rank 0 .*left out the tied embedding"),
    (check_global_grad_norm, norm_counting_tied_tp_times,
     "rank 0 .*counted the tied embedding on every tp rank"),
    (check_loss_scale, skip_alone, "step 2 \\(an inf on rank 1 only.*\\): rank 1 skipped the "
                                   "step but rank 0 did not \\(only the ranks whose own"),
    (check_loss_scale, skip_on_inf_only, "a nan on rank 0 only.*no rank skipped: a nan is"),
    (check_loss_scale, skip_by_sum, "an inf on every rank.*compare the sum with > 0"),
    (check_loss_scale, halve_without_skipping, "halved the scale but did not skip"),
    (check_loss_scale, skip_without_halving, "returned scale 1024 .*expected 512.*: halve"),
    (check_loss_scale, never_grows, "step 1 .*expected 2048 and 0: the scale never grows back"),
    (check_loss_scale, grows_without_reset, "step 1 .*reset clean_steps to 0 when you double"),
    (check_loss_scale, counts_through_overflow, "step 2 .*start counting again after an "
                                                "overflow"),
    (check_loss_scale, grows_every_step, "step 0 .*grew after 1 clean step"),
    (check_global_grad_norm, global_norm, "the library's own implementation"),
    (check_loss_scale, LossScaler(enabled=True).unscale_and_check,
     "the library's own implementation"),
    (check_global_grad_norm, not_written, "not written yet"),
    (check_loss_scale, not_written, "not written yet"),
], ids=lambda v: getattr(v, "__name__", None))
@pytest.mark.slow  # the checks start their own ranks, once per mistake
def test_usual_mistakes_get_a_hint(check, fn, words):
    with pytest.raises(ExerciseError, match=words):
        check(fn)


def test_tied_mistakes_told_apart_where_they_differ():
    """On tp=2 x pp=2 the tied embedding counted twice reads the same whether on both ends
    or on both tp ranks, so the hint names both; one dimension alone tells them apart."""
    with pytest.raises(ExerciseError, match="tp=1 x pp=2, rank 0 .*on both ends of the "
                                            "pipeline[^;]*$"):
        check_global_grad_norm(norm_counting_tied_twice, layouts=((1, 2),))
    with pytest.raises(ExerciseError, match="tp=2 x pp=1, rank 0 .*counted the tied embedding "
                                            "on every tp rank[^;]*$"):
        check_global_grad_norm(norm_counting_tied_tp_times, layouts=((2, 1),))
