"""Lesson 07's checks pass the right answers and name the usual mistakes."""

import itertools
import math

import pytest
import torch.distributed as dist

from minipar.grading import ExerciseError
from minipar.mesh.exercises import check_mesh_groups, check_pick_degrees
from minipar.mesh.planner import Layout, estimate

# the exercise checks' ranks compute on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


def connect(dims, *, fastest_last=True, only_mine=False, lists=False):
    names = list(dims) if fastest_last else list(reversed(dims))
    me, mine = dist.get_rank(), {}
    for name in dims:
        found = {}
        for r in range(math.prod(dims.values())):
            rest, coords = r, {}
            for n in reversed(names):
                rest, coords[n] = divmod(rest, dims[n])
            found.setdefault(tuple(v for n, v in coords.items() if n != name), []).append(r)
        for ranks in found.values():
            if only_mine and me not in ranks:
                continue
            group = dist.new_group(ranks)
            if me in ranks:
                mine[name] = ranks if lists else group
    return mine


def connect_right(dims):
    return connect(dims)


def connect_column_major(dims):
    return connect(dims, fastest_last=False)


def connect_rank_lists(dims):
    return connect(dims, lists=True)


def connect_only_mine(dims):
    return connect(dims, only_mine=True)


def not_written(dims):
    raise NotImplementedError("exercise connect_mesh: write your code here")


@pytest.mark.slow  # the check trains on 8 ranks
def test_mesh_groups_check_accepts_the_right_answer():
    assert "every rank's group right" in check_mesh_groups(connect_right)


@pytest.mark.parametrize("fn, words", [
    (connect_column_major, r"rank 0's dp group holds ranks \[0, 1\], expected \[0, 2\].*"
                           "column-major"),
    (connect_rank_lists, "return the ProcessGroup"),
    (not_written, "not written yet"),
])
def test_mesh_groups_check_names_the_mistake(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_mesh_groups(fn, meshes=({"dp": 2, "tp": 2},))


@pytest.mark.slow  # the check trains on 8 ranks, once per mistake
def test_mesh_groups_check_turns_skipped_groups_into_advice():
    with pytest.raises(ExerciseError, match="every rank must call dist.new_group for every group"):
        check_mesh_groups(connect_only_mine, meshes=({"dp": 2, "tp": 2},), timeout=8)


def pick(model, cluster, batch, *, fits=True, fastest=True, heads=True):
    found = []
    n = cluster.devices
    for dp, pp, tp in itertools.product(range(1, n + 1), repeat=3):
        if dp * pp * tp != n or (heads and (model.heads % tp or model.layers % pp)):
            continue
        p = estimate(model, cluster, batch, Layout(dp, pp, tp, zero=int(dp > 1)))
        if p.memory <= cluster.memory_bytes or not fits:
            found.append(p)
    best = (min if fastest else max)(found, key=lambda p: p.step)
    return best.dp, best.pp, best.tp


def pick_right(model, cluster, batch):
    return pick(model, cluster, batch)


def pick_ignoring_memory(model, cluster, batch):
    return pick(model, cluster, batch, fits=False)


def pick_slowest(model, cluster, batch):
    return pick(model, cluster, batch, fastest=False)


def test_pick_degrees_check_accepts_the_right_answer():
    assert "planner's choice" in check_pick_degrees(pick_right)


@pytest.mark.parametrize("fn, words", [
    (pick_ignoring_memory, "needs .* GB per device, the device has"),
    (pick_slowest, r"takes .* s per step; dp=\d+ pp=\d+ tp=\d+ fits and takes .* loses most in"),
    (lambda m, c, b: (8, 1, 8), "dp \\* pp \\* tp = 64, but the cluster has 16"),
    (lambda m, c, b: (1, 16, 1), "pp=16 the 24 layers"),
    (lambda m, c, b: "dp=2", "return \\(dp, pp, tp\\)"),
])
def test_pick_degrees_check_names_the_mistake(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_pick_degrees(fn)
