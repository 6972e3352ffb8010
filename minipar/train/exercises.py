"""Lesson 11's exercise checks: the gradient norm across a tp x pp layout, and the fp16
step that every rank skips when any rank's gradients overflowed."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..mesh import Mesh

# one stage's gradients: a column shard, a norm's gain (replicated over tp), a row shard,
# the output bias (replicated); the gain is large, so counting it tp times shows
_SHAPES = ((3, 4), (4,), (4, 3), (4,))
_REPLICATED = (False, True, False, True)
_LAYOUTS = ((2, 2), (2, 1), (1, 2))  # (tp, pp): the 4-rank layout first catches most mistakes


def _gradient(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _stage_gradients(stage: int, tp_rank: int) -> list[torch.Tensor]:
    """Stage `stage`'s gradients as tp rank `tp_rank` holds them: shards seeded per
    (stage, tp rank), replicated tensors per stage only (the same on every tp rank)."""
    grads = []
    for i, (shape, rep) in enumerate(zip(_SHAPES, _REPLICATED, strict=True)):
        if rep:  # no tp rank in the seed: every tp rank holds the same values
            grads.append(3 * _gradient(shape, 100 * stage + i))
        else:
            grads.append(_gradient(shape, 100 * stage + 10 * (tp_rank + 1) + i))
    return grads


def _squares(stage: int, tp_rank: int, replicated: bool) -> float:
    """Sum of squares of one rank's shards, or of its stage's replicated tensors."""
    return sum(float(g.pow(2).sum()) for g, rep in
               zip(_stage_gradients(stage, tp_rank), _REPLICATED, strict=True) if rep == replicated)


def _run_norm(fn: Callable, tp: int, pp: int) -> dict:
    groups = Mesh(pp=pp, tp=tp).connect()
    stage, tp_rank = groups.coords["pp"], groups.coords["tp"]
    # fresh tensors and list: the reference regenerates its own, whatever the learner edits
    out = fn(_stage_gradients(stage, tp_rank), list(_REPLICATED), groups.tp, groups.pp)
    try:
        return {"norm": float(out)}
    except (TypeError, ValueError, RuntimeError):
        return {"type": type(out).__name__}


_TP_TIMES = ("counted the replicated tensors (replicated[i] True) once per tp rank, tp times "
             "in all: add their squares on one tp rank only (e.g. tp rank 0), or divide them "
             "by the tp size")
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
    wrong = []
    for w in weights:
        local = {(s, r): shards[s][r] + w(r) * rep[s] for s in range(pp) for r in range(tp)}
        if tp > 1 and w(1) == 1.0:  # every rank counts them: a mistake even if all else is right
            wrong.append((_TP_TIMES, math.sqrt(sum(local.values()))))
        wrong.append((_NORMS, sum(math.sqrt(v) for v in local.values())))
        if pp > 1:
            wrong.append((_NO_PP, math.sqrt(sum(local[stage, r] for r in range(tp)))))
        if tp > 1:
            wrong.append((_NO_TP, math.sqrt(sum(local[s, tp_rank] for s in range(pp)))))
    return wrong


def check_global_grad_norm(global_grad_norm: Callable,
                           layouts: tuple[tuple[int, int], ...] = _LAYOUTS) -> str:
    """`global_grad_norm(grads, replicated, tp_group, pp_group) -> float` on every rank of
    a tp x pp layout: `grads` this rank's gradients, `replicated[i]` True where grads[i]
    is the same on every tp rank. Every rank must return the norm one process would
    compute over the whole model, each entry counted once."""
    refuse_library("global_grad_norm", global_grad_norm)
    for tp, pp in layouts:
        got = run_on_ranks("global_grad_norm", _run_norm, tp * pp, global_grad_norm, tp, pp)
        want = math.sqrt(sum(_squares(s, r, False) + (r == 0) * _squares(s, 0, True)
                             for s in range(pp) for r in range(tp)))
        for r, out in enumerate(got):
            stage, tp_rank = divmod(r, tp)  # Mesh(pp=, tp=): tp is the fastest dimension
            where = f"global_grad_norm on tp={tp} x pp={pp}, rank {r} (stage {stage}, tp rank " \
                    f"{tp_rank})"
            if "type" in out:
                raise ExerciseError(f"{where}: returned a {out['type']}; return one number, "
                                    "a float or a one-element tensor")
            if math.isclose(out["norm"], want, rel_tol=1e-6):
                continue
            hint = next((h for h, v in _wrong_norms(tp, pp, stage, tp_rank)
                         if math.isclose(out["norm"], v, rel_tol=1e-6)),
                        "is off some other way: sum the squares of your shards and, once per "
                        "tp group, of the replicated tensors; all-reduce that sum over tp_group "
                        "and pp_group; then take the square root")
            raise ExerciseError(f"{where}: returned {out['norm']:.6g}, not one process's "
                                f"{want:.6g}; it {hint}")
    return ("global_grad_norm: one process's norm on every rank of "
            f"{', '.join(f'tp={tp} x pp={pp}' for tp, pp in layouts)}; replicated tensors "
            "counted once")


_SCALE = 1024.0
# (what happens, which ranks' gradients hold what): None = every rank
_SCENARIOS = (("no overflow anywhere", (), ""), ("an inf on rank 1 only", (1,), "inf"),
              ("a nan on rank 0 only", (0,), "nan"), ("an inf on every rank", None, "inf"))


def _dp_gradients(rank: int, scenario: int) -> list[torch.Tensor]:
    """A data-parallel rank's fp16 gradients in one scenario, with its inf or nan if any."""
    _, bad_ranks, value = _SCENARIOS[scenario]
    generator = torch.Generator().manual_seed(10 * scenario + rank)
    grads = [torch.randn(shape, generator=generator).half() for shape in ((4, 3), (3,))]
    if value and (bad_ranks is None or rank in bad_ranks):
        grads[1][2] = float(value)  # one entry is enough: the whole step is spoiled
    return grads


def _run_skip(fn: Callable) -> list[dict]:
    results = []
    for scenario in range(len(_SCENARIOS)):
        out = fn(_dp_gradients(runtime.rank(), scenario), _SCALE)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            return [{"type": type(out).__name__}]
        results.append({"skip": bool(out[0]), "scale": float(out[1])})
    return results


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _skip_hint(scenario: int, got: list[dict]) -> str | None:
    """What is wrong in one scenario, or None when every rank did the right thing."""
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
    want_scale = _SCALE / 2 if want_skip else _SCALE
    wrong = [r for r, out in enumerate(got) if out["scale"] != want_scale]
    if not wrong:
        return None
    scale = got[wrong[0]]["scale"]
    if want_skip:
        return (f"{_ranks(wrong)} skipped but returned the scale {scale:g}, not {want_scale:g}: "
                "halve it on every rank after an overflow, or the next step overflows again")
    return (f"{_ranks(wrong)} returned the scale {scale:g} after a clean step; keep it at "
            f"{want_scale:g} (this exercise has no growth)")


def check_overflow_skip(skip_on_overflow: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`skip_on_overflow(grads, scale) -> (skip, new_scale)` on every rank of a data-parallel
    group, with fp16 `grads` still multiplied by the loss scale: if any rank's gradients
    hold an inf or nan, every rank must skip the step and halve the scale; otherwise none
    skips and the scale stays."""
    refuse_library("skip_on_overflow", skip_on_overflow)
    for k in world_sizes:
        got = run_on_ranks("skip_on_overflow", _run_skip, k, skip_on_overflow)
        for r, results in enumerate(got):
            if "type" in results[0]:
                raise ExerciseError(f"skip_on_overflow on {k} ranks: rank {r} returned a "
                                    f"{results[0]['type']}; return a tuple (skip, new_scale)")
        for scenario, (what, _, _) in enumerate(_SCENARIOS):
            hint = _skip_hint(scenario, [results[scenario] for results in got])
            if hint:
                raise ExerciseError(f"skip_on_overflow on {k} ranks, {what}: {hint}")
    return (f"skip_on_overflow: on {', '.join(map(str, world_sizes))} ranks every rank skips "
            "and halves the scale when any rank's gradients hold an inf or nan, and only then")
