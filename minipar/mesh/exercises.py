"""Lesson 07's exercise checks: a mesh's process groups on real ranks, and picking the
degrees for a cluster, graded against the planner."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import runtime
from ..cost import GB, OPT_CONFIGS, TransformerConfig
from ..grading import ExerciseError, refuse_library, run_on_ranks
from .mesh import Mesh
from .planner import Hardware, Layout, Plan, estimate, plan

_MESHES = ({"dp": 2, "tp": 2}, {"dp": 2, "pp": 2, "tp": 2})
_GROUPS_HINT = ("torch creates a group collectively: every rank must call dist.new_group for "
                "every group of every dimension, in the same order, even the groups it is not "
                "in, and keep the one it is in.")


def _run_groups(fn: Callable, dims: dict[str, int]) -> dict | str:
    """On one rank: call the learner's function, recording every dist.new_group call, then
    find out who is really in each group it returned by all-reducing one-hot rank vectors
    over that group."""
    import torch.distributed.distributed_c10d as c10d

    from . import mesh as mesh_module

    def refuse(*args, **kwargs):
        raise ExerciseError("connect_mesh: that calls minipar's Mesh.connect; build the groups "
                            "with dist.new_group yourself")

    calls, original = [], c10d.new_group

    def recorded(ranks=None, *args, **kwargs):
        calls.append(sorted(ranks) if ranks is not None else None)
        return original(ranks, *args, **kwargs)

    connect, mesh_module.Mesh.connect = mesh_module.Mesh.connect, refuse
    # both names: a learner may reach new_group through dist or through c10d itself
    dist.new_group = c10d.new_group = recorded
    try:
        groups = fn(dict(dims))
    finally:  # the rank may serve later work: put both back
        dist.new_group = c10d.new_group = original
        mesh_module.Mesh.connect = connect
    if not isinstance(groups, dict):
        return f"returned {type(groups).__name__}, not a dict of dimension name -> group"
    out = {}
    for name in dims:
        group = groups.get(name)
        if not isinstance(group, dist.ProcessGroup):
            return (f"groups[{name!r}] is {type(group).__name__}; return the ProcessGroup "
                    "dist.new_group gave you, not its rank list")
    if len({str(c) for c in _gather_calls(calls)}) > 1:
        return {"calls": calls, "members": None}  # groups paired up wrongly: do not use them
    for name in dims:
        members = torch.zeros(runtime.world_size(), dtype=torch.float64,
                              device=runtime.device())
        # one-hot rank vectors summed over the group: the ones mark who is really in it
        members[runtime.rank()] = 1
        dist.all_reduce(members, group=groups[name])
        out[name] = [r for r, v in enumerate(members.tolist()) if v]
    return {"calls": calls, "members": out}


def _gather_calls(calls: list) -> list:
    """Every rank's list of new_group calls (over the default group, which is intact)."""
    everyone = [None] * runtime.world_size()
    dist.all_gather_object(everyone, calls)
    return everyone


def check_mesh_groups(connect_mesh: Callable, meshes: tuple[dict[str, int], ...] = _MESHES,
                      timeout: float = 30) -> str:
    """`connect_mesh(dims)` on every rank: dims like {"dp": 2, "pp": 2, "tp": 2}, ranks
    numbered row-major (first dimension outermost, the last fastest, as Mesh does); return
    this rank's process group for each dimension. Graded by all-reducing over each group
    and looking at who answered."""
    refuse_library("connect_mesh", connect_mesh)
    for dims in meshes:
        mesh = Mesh(**dims)
        shape = " x ".join(f"{n}={s}" for n, s in dims.items())
        got = run_on_ranks("connect_mesh", _run_groups, mesh.size, connect_mesh, dims,
                           timeout=timeout, deadlock_hint=_GROUPS_HINT)
        for r, result in enumerate(got):
            if isinstance(result, str):
                raise ExerciseError(f"connect_mesh({shape}) on rank {r}: {result}")
            if result["calls"] != got[0]["calls"]:
                raise ExerciseError(
                    f"connect_mesh({shape}): rank {r} created the groups {result['calls']}, "
                    f"rank 0 created {got[0]['calls']}. " + _GROUPS_HINT)
        for r, result in enumerate(got):
            mine = result["members"]
            for name in dims:
                want = mesh.group_of(name, r)
                if mine[name] == want:
                    continue
                fastest = mesh.names[-1]
                why = (f"ranks differ only along {name} when every other coordinate agrees; "
                       f"number ranks row-major: {fastest} varies fastest, so rank r has "
                       f"{fastest} = r % {mesh[fastest]}")
                if mine[name] == [g for g in Mesh(**dict(reversed(dims.items()))).group_of(
                        name, r)] and mine[name] != want:
                    why = (f"that is the group of a mesh numbered with {mesh.names[0]} fastest "
                           f"(column-major); the last dimension, {fastest}, must vary fastest "
                           "so that a tp group is neighbouring ranks, inside one node")
                raise ExerciseError(
                    f"connect_mesh({shape}): rank {r}'s {name} group holds ranks {mine[name]}, "
                    f"expected {want}: {why}.")
    return (f"connect_mesh: every rank's group right along every dimension of "
            f"{', '.join(' x '.join(f'{n}={s}' for n, s in d.items()) for d in meshes)}")


# three clusters with three different winners: the NIC is fast, the NIC is slow, the
# memory is small
def degree_cases() -> list[tuple[str, TransformerConfig, Hardware, int]]:
    """(name, model, cluster, global batch) on which `check_pick_degrees` grades."""
    fast = Hardware(2, 8, 312e12, 80 * GB, 300e9, 25e9, name="2 x 8 A100 80GB")
    # 1.25e9 bytes/s = 10 Gb/s; the others are an A100's 312 TFLOP/s bf16 and 25 GB/s (200 Gb/s)
    slow = Hardware(2, 8, 312e12, 80 * GB, 300e9, 1.25e9, name="2 x 8 A100, 10 Gb/s NICs")
    small = Hardware(2, 8, 312e12, 24 * GB, 300e9, 25e9, name="2 x 8 24 GB GPUs")
    return [("OPT-1.3B on 2 x 8 A100 80GB", OPT_CONFIGS["1.3B"], fast, 64),
            ("OPT-1.3B on 2 x 8 A100, 10 Gb/s NICs", OPT_CONFIGS["1.3B"], slow, 64),
            ("OPT-13B on 2 x 8 GPUs of 24 GB", OPT_CONFIGS["13B"], small, 64)]


def best_degrees(model: TransformerConfig, cluster: Hardware, global_batch: int) -> Plan:
    """The planner's winner with the exercise's fixed choices (micro-batch 1, ZeRO-1 where
    dp > 1, selective recomputation)."""
    found = plan(model, cluster, global_batch, micro_batches=(1,), zero_stages=(0, 1),
                 recompute=("selective",))
    return found[0]


def check_pick_degrees(pick_degrees: Callable, tolerance: float = 0.02) -> str:
    """`pick_degrees(model, cluster, global_batch)` -> (dp, pp, tp): the fastest degrees
    that fit in memory, found with `estimate(model, cluster, global_batch, Layout(dp, pp,
    tp, zero=1 where dp > 1))` (micro-batch 1, selective recomputation). Graded against
    the planner on three clusters."""
    refuse_library("pick_degrees", pick_degrees)
    winners = []
    for name, model, cluster, batch in degree_cases():
        best = best_degrees(model, cluster, batch)
        try:
            got = pick_degrees(model, cluster, batch)
        except NotImplementedError:
            raise ExerciseError("pick_degrees: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        try:
            dp, pp, tp = (int(v) for v in got)
        except (TypeError, ValueError):
            raise ExerciseError(f"pick_degrees({name}): return (dp, pp, tp); got {got!r}") \
                from None
        if dp * pp * tp != cluster.devices:
            raise ExerciseError(f"pick_degrees({name}): dp * pp * tp = {dp * pp * tp}, but the "
                                f"cluster has {cluster.devices} devices; use them all")
        if model.heads % tp or model.layers % pp:
            raise ExerciseError(f"pick_degrees({name}): tp={tp} must divide the {model.heads} "
                                f"heads and pp={pp} the {model.layers} layers")
        mine = estimate(model, cluster, batch, Layout(dp, pp, tp, zero=int(dp > 1)))
        if mine.memory > cluster.memory_bytes:
            raise ExerciseError(
                f"pick_degrees({name}): dp={dp} pp={pp} tp={tp} needs {mine.memory / GB:.0f} GB "
                f"per device, the device has {cluster.memory_bytes / GB:.0f}: keep only "
                "configurations whose estimate(...).memory fits")
        if mine.step > best.step * (1 + tolerance):
            worst = max(mine.seconds, key=lambda k: mine.seconds[k] - best.seconds.get(k, 0))
            raise ExerciseError(
                f"pick_degrees({name}): dp={dp} pp={pp} tp={tp} takes {mine.step:.2f} s per "
                f"step; dp={best.dp} pp={best.pp} tp={best.tp} fits and takes "
                f"{best.step:.2f} s. Yours loses most in '{worst}' ({mine.seconds[worst]:.2f} s "
                f"vs {best.seconds.get(worst, 0):.2f} s). Try every (dp, pp, tp) and keep the "
                "fastest that fits.")
        big = max((k for k in mine.seconds if k != "compute"), key=mine.seconds.__getitem__)
        winners.append(f"  {name}: dp={dp} pp={pp} tp={tp}, {mine.step:.2f} s per step, "
                       f"{mine.memory / GB:.0f} GB; largest cost after compute: {big}")
    return "\n".join(["pick_degrees: the planner's choice (or one as fast) on every cluster",
                      *winners])
