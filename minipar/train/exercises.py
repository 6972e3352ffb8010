"""Lesson 11's exercise checks: the gradient norm across a tp x pp layout, a tied embedding
on both pipeline ends included, and fp16's dynamic loss scale, which every rank skips and
halves together when any rank's gradients overflowed and grows back after a run of clean
steps."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..mesh import Mesh
from .precision import LossScaler

# one stage's gradients: a column shard, a norm's gain (replicated over tp), a row shard,
# the output bias (replicated); the gain is large, so counting it tp times shows
_SHAPES = ((3, 4), (4,), (4, 3), (4,))
_REPLICATED = (False, True, False, True)
# the tied embedding: first in the first stage's list, last in the last stage's (the head),
# one summed gradient on both ends, replicated over tp (a model whose embedding is not split
# by vocabulary; minipar's trainer splits it, deep dive 04b, and counts each rank's rows)
_TIED_SHAPE = (5, 4)
_LAYOUTS = ((2, 2), (2, 1), (1, 2))  # (tp, pp): the 4-rank layout first catches most mistakes


def _gradient(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # a CPU generator draws on the host: moved just below
    grad = torch.randn(shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))
    return grad.to(runtime.device())


def _tied_gradient() -> torch.Tensor:
    return 2 * _gradient(_TIED_SHAPE, 7)


def _stage_gradients(stage: int, tp_rank: int, pp: int = 1) -> list[tuple[torch.Tensor, bool,
                                                                           bool]]:
    """Stage `stage`'s (gradient, replicated, tied) as tp rank `tp_rank` holds them: shards
    seeded per (stage, tp rank), replicated tensors per stage only (the same on every tp
    rank), the tied embedding on the first stage and, when pp > 1, again on the last."""
    grads = []
    for i, (shape, rep) in enumerate(zip(_SHAPES, _REPLICATED, strict=True)):
        if rep:  # no tp rank in the seed: every tp rank holds the same values
            grads.append((3 * _gradient(shape, 100 * stage + i), True, False))
        else:
            grads.append((_gradient(shape, 100 * stage + 10 * (tp_rank + 1) + i), False, False))
    if stage == 0:
        grads.insert(0, (_tied_gradient(), True, True))
    if stage == pp - 1 and pp > 1:
        grads.append((_tied_gradient(), True, True))
    return grads


def _squares(stage: int, tp_rank: int, replicated: bool) -> float:
    """Sum of squares of one rank's shards, or of its stage's replicated tensors (the tied
    embedding left out: `_TIED` holds it)."""
    return sum(float(g.pow(2).sum()) for g, rep, tie in _stage_gradients(stage, tp_rank)
               if rep == replicated and not tie)


_TIED = float(_tied_gradient().pow(2).sum())


def _run_norm(fn: Callable, tp: int, pp: int) -> dict:
    groups = Mesh(pp=pp, tp=tp).connect()
    stage, tp_rank = groups.coords["pp"], groups.coords["tp"]
    # fresh tensors and lists: the reference regenerates its own, whatever the learner edits
    held = _stage_gradients(stage, tp_rank, pp)
    out = fn([g for g, _, _ in held], [rep for _, rep, _ in held], [tie for _, _, tie in held],
             groups.tp, groups.pp)
    try:
        return {"norm": float(out)}
    except (TypeError, ValueError, RuntimeError):
        return {"type": type(out).__name__}


_TP_TIMES = ("counted the replicated tensors (replicated[i] True) once per tp rank, tp times "
             "in all: add their squares on one tp rank only (e.g. tp rank 0), or divide them "
             "by the tp size")
_TIED_TP = ("counted the tied embedding on every tp rank: it is replicated over tp too "
            "(replicated[i] True), so count it on one tp rank of the first stage only")
_TIED_TWICE = ("counted the tied embedding (tied[i] True) on both ends of the pipeline: the "
               "first and last stages hold the same summed gradient, so add its squares on the "
               "first stage only (dist.get_rank(pp_group) == 0)")
_TIED_NONE = ("left out the tied embedding (tied[i] True): it is one tensor of the model, so "
              "count it once, on the first stage")
_NORMS = ("summed norms, not squares: take the square root once, after both all-reduces of "
          "the sum of squares")
_NO_PP = ("returned only its own stage's part: all-reduce the sum of squares over pp_group "
          "too, each stage holds different layers")
_NO_TP = ("left out the other tp ranks' shards: all-reduce the sum of squares over tp_group "
          "too, each tp rank holds different slices")


def _wrong_norms(tp: int, pp: int, stage: int, tp_rank: int) -> list[tuple[str, float]]:
    """What rank (stage, tp_rank) returns after each usual mistake, with its hint."""
    shards = {s: [_squares(s, r, False) for r in range(tp)] for s in range(pp)}
    rep = {s: _squares(s, 0, True) for s in range(pp)}
    # how a rank may count the replicated tensors: by one tp rank, a 1/tp share each, every rank
    weights = (lambda r: 1.0 if r == 0 else 0.0, lambda r: 1 / tp, lambda r: 1.0)
    # which stages count the tied embedding: the first (right), both ends, none
    ends = {"first": lambda s: s == 0, "both": lambda s: s in (0, pp - 1), "none": lambda s: False}
    wrong = []
    for w in weights:
        for tied_w in dict.fromkeys((w, weights[2])):  # the tied one like the rest, or everywhere
            for end, counts in ends.items():
                if end == "both" and pp == 1:  # one stage holds one copy: same as "first"
                    continue
                local = {(s, r): shards[s][r] + w(r) * rep[s] + tied_w(r) * counts(s) * _TIED
                         for s in range(pp) for r in range(tp)}
                counting = (_TP_TIMES if tp > 1 and w(1) == 1.0 else
                            _TIED_TP if tp > 1 and tied_w(1) == 1.0 and counts(0) else
                            _TIED_TWICE if end == "both" else
                            _TIED_NONE if end == "none" else None)
                if counting:  # a mistake even if all else is right
                    wrong.append((counting, math.sqrt(sum(local.values()))))
                wrong.append((_NORMS, sum(math.sqrt(v) for v in local.values())))
                if pp > 1:
                    wrong.append((_NO_PP, math.sqrt(sum(local[stage, r] for r in range(tp)))))
                if tp > 1:
                    wrong.append((_NO_TP, math.sqrt(sum(local[s, tp_rank] for s in range(pp)))))
    return wrong


def check_global_grad_norm(global_grad_norm: Callable,
                           layouts: tuple[tuple[int, int], ...] = _LAYOUTS) -> str:
    """`global_grad_norm(grads, replicated, tied, tp_group, pp_group) -> float` on every
    rank of a tp x pp layout: `grads` this rank's gradients, `replicated[i]` True where
    grads[i] is the same on every tp rank, `tied[i]` True for the tied embedding, whose
    summed gradient the first and last stages both hold. Every rank must return the norm
    one process would compute over the whole model, each entry counted once."""
    refuse_library("global_grad_norm", global_grad_norm)
    for tp, pp in layouts:
        got = run_on_ranks("global_grad_norm", _run_norm, tp * pp, global_grad_norm, tp, pp)
        want = math.sqrt(sum(_squares(s, r, False) + (r == 0) * _squares(s, 0, True)
                             for s in range(pp) for r in range(tp)) + _TIED)
        for r, out in enumerate(got):
            stage, tp_rank = divmod(r, tp)  # Mesh(pp=, tp=): tp is the fastest dimension
            where = f"global_grad_norm on tp={tp} x pp={pp}, rank {r} (stage {stage}, tp rank " \
                    f"{tp_rank})"
            if "type" in out:
                raise ExerciseError(f"{where}: returned a {out['type']}; return one number, "
                                    "a float or a one-element tensor")
            if math.isclose(out["norm"], want, rel_tol=1e-6):
                continue
            # distinct mistakes can give one number (on tp=2 x pp=2 the tied embedding counted
            # on both tp ranks or on both ends): name the first two that match
            hints = list(dict.fromkeys(h for h, v in _wrong_norms(tp, pp, stage, tp_rank)
                                       if math.isclose(out["norm"], v, rel_tol=1e-6)))[:2]
            hint = "; or it ".join(hints) or (
                "is off some other way: sum the squares of your shards and, once per tp group, "
                "of the replicated tensors (the tied embedding on the first stage only); "
                "all-reduce that sum over tp_group and pp_group; then take the square root")
            raise ExerciseError(f"{where}: returned {out['norm']:.6g}, not one process's "
                                f"{want:.6g}; it {hint}")
    return ("global_grad_norm: one process's norm on every rank of "
            f"{', '.join(f'tp={tp} x pp={pp}' for tp, pp in layouts)}; replicated tensors "
            "counted once, the tied embedding on the first stage only")


_SCALE = 1024.0
INTERVAL = 2  # clean steps in a row before the scale doubles (torch's growth_interval)
# (what happens, which ranks' gradients hold what): None = every rank
_SCENARIOS = (("no overflow anywhere", (), ""), ("an inf on rank 1 only", (1,), "inf"),
              ("a nan on rank 0 only", (0,), "nan"), ("an inf on every rank", None, "inf"))
# the steps the check runs, as (scenario, clean steps already in a row): each step's
# expected answer follows from these alone, so every step is judged on its own
_STEPS = ((0, 0), (0, 1), (1, 1), (0, 0), (2, 0), (3, 1))


def _dp_gradients(rank: int, scenario: int) -> list[torch.Tensor]:
    """A data-parallel rank's fp16 gradients in one scenario, with its inf or nan if any."""
    _, bad_ranks, value = _SCENARIOS[scenario]
    generator = torch.Generator().manual_seed(10 * scenario + rank)
    # a CPU generator draws on the host: moved just below
    grads = [torch.randn(shape, generator=generator, dtype=torch.float32).half()
             .to(runtime.device()) for shape in ((4, 3), (3,))]
    if value and (bad_ranks is None or rank in bad_ranks):
        grads[1][2] = float(value)  # one entry is enough: the whole step is spoiled
    return grads


def _run_scale(fn: Callable) -> list[dict]:
    results = []
    for scenario, clean in _STEPS:
        out = fn(_dp_gradients(runtime.rank(), scenario), _SCALE, clean, INTERVAL)
        if not (isinstance(out, (tuple, list)) and len(out) == 3):
            return [{"type": type(out).__name__}]
        results.append({"skip": bool(out[0]), "scale": float(out[1]), "clean": int(out[2])})
    return results


def expected_scale(overflow: bool, scale: float, clean: int, interval: int) -> tuple:
    """(skip, scale, clean steps in a row) after one step, as the trainer's `LossScaler`
    updates it: halve and start counting again on an overflow; otherwise count the step,
    and double once `interval` are in a row (the count starts again from there)."""
    scaler = LossScaler(enabled=True, scale=scale, interval=interval)
    scaler.good_steps = clean
    scaler.update(overflow)
    return overflow, scaler.scale, scaler.good_steps % interval


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _skip_hint(scenario: int, got: list[dict]) -> str | None:
    """Whether every rank skipped exactly when it should: what is wrong, or None."""
    _, bad_ranks, value = _SCENARIOS[scenario]
    k = len(got)
    overflowed = list(range(k)) if bad_ranks is None else list(bad_ranks)
    want_skip = bool(value)
    skipped = [r for r, out in enumerate(got) if out["skip"]]
    stepped = [r for r, out in enumerate(got) if not out["skip"]]
    if skipped and stepped:
        why = (" (only the ranks whose own gradients overflowed skipped)"
               if skipped == overflowed else "")
        return (f"{_ranks(skipped)} skipped the step but {_ranks(stepped)} did not{why}, so "
                "the replicas hold different weights from this step on and never agree again. "
                "All-reduce an overflow flag over the group with MAX (any rank's inf or nan "
                "is every rank's), then decide")
    if stepped and want_skip:
        if all(out["scale"] == _SCALE / 2 for out in got):
            return ("every rank halved the scale but did not skip: return skip=True too; a "
                    "step on inf or nan gradients writes them into the weights")
        if value == "nan":
            return ("no rank skipped: a nan is an overflow too (inf - inf, 0 * inf); "
                    "torch.isfinite(g).all() is False for both inf and nan")
        if bad_ranks is None:
            return (f"no rank skipped although all {k} overflowed: if you all-reduce a flag "
                    "with SUM, compare the sum with > 0 (here it is the number of ranks), or "
                    "all-reduce with MAX")
        return ("no rank skipped: check every gradient with torch.isfinite, and skip if any "
                "entry on any rank is not finite")
    if skipped and not want_skip:
        return ("every rank skipped although every gradient is finite: skip only when some "
                "entry is inf or nan (not torch.isfinite(g).all())")
    return None


def _scale_hint(scenario: int, clean: int, got: list[dict]) -> str | None:
    """Whether every rank returned the right scale and count of clean steps."""
    want = expected_scale(bool(_SCENARIOS[scenario][2]), _SCALE, clean, INTERVAL)
    wrong = [r for r, out in enumerate(got) if (out["scale"], out["clean"]) != want[1:]]
    if not wrong:
        return None
    out = got[wrong[0]]
    scale, count = out["scale"], out["clean"]
    told = (f"{_ranks(wrong)} returned scale {scale:g} and clean_steps {count}, expected "
            f"{want[1]:g} and {want[2]}")
    if want[0]:
        if scale != want[1]:
            return f"{told}: halve the scale on every rank after an overflow"
        return (f"{told}: start counting again after an overflow (clean_steps 0): the "
                "scale grows only after steps in a row without one")
    if want[1] > _SCALE and scale == _SCALE:
        return (f"{told}: the scale never grows back: double it after `interval` clean steps "
                "in a row (torch's GradScaler: growth_interval), or one overflow leaves it low "
                "for the rest of the run, and small gradients underflow to 0 in fp16")
    if want[1] > _SCALE:
        return f"{told}: reset clean_steps to 0 when you double the scale"
    if scale > _SCALE:
        return (f"{told}: the scale grew after {clean + 1} clean step(s); double it only once "
                "`interval` clean steps are in a row")
    return f"{told}: count this clean step (clean_steps + 1), and keep the scale until it grows"


def check_loss_scale(update_loss_scale: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`update_loss_scale(grads, scale, clean_steps, interval) -> (skip, scale, clean_steps)`
    on every rank of a data-parallel group, with fp16 `grads` still multiplied by the loss
    scale: if any rank's gradients hold an inf or nan, every rank skips the step, halves
    the scale and starts counting clean steps again; otherwise it counts the step, and
    after `interval` clean steps in a row doubles the scale (`expected_scale`)."""
    refuse_library("update_loss_scale", update_loss_scale)
    for k in world_sizes:
        got = run_on_ranks("update_loss_scale", _run_scale, k, update_loss_scale)
        for r, results in enumerate(got):
            if "type" in results[0]:
                raise ExerciseError(f"update_loss_scale on {k} ranks: rank {r} returned a "
                                    f"{results[0]['type']}; return a tuple (skip, scale, "
                                    "clean_steps)")
        for step, (scenario, clean) in enumerate(_STEPS):
            outs = [results[step] for results in got]
            hint = _skip_hint(scenario, outs) or _scale_hint(scenario, clean, outs)
            if hint:
                raise ExerciseError(
                    f"update_loss_scale on {k} ranks, step {step} ({_SCENARIOS[scenario][0]}, "
                    f"scale {_SCALE:g}, {clean} clean step(s) before it, interval {INTERVAL}): "
                    f"{hint}")
    return (f"update_loss_scale: on {', '.join(map(str, world_sizes))} ranks every rank skips, "
            "halves the scale and counts again when any rank overflows, and doubles it after "
            f"{INTERVAL} clean steps in a row")
