"""PipeFisher: K-FAC's direction is the stated formula, a pipeline running its curvature
work in the bubbles trains exactly as one process does, and the bubbles are found where
the simulator says the ranks wait."""

import pytest
import torch
from torch import nn

from minipar.pipeline import schedule, simulate
from minipar.pipeline.kfac import KFAC, kfac_step
from minipar.pipeline.pipefisher import kfac_one_process, train_pipefisher
from minipar.pipeline.simulate import bubble_budgets


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, dtype=torch.float64), nn.Tanh(),
                         nn.Linear(8, 8, dtype=torch.float64), nn.Tanh(),
                         nn.Linear(8, 3, dtype=torch.float64))


def _batches(steps=4, rows=12):
    torch.manual_seed(1)
    scales = torch.logspace(-1, 1, 6, dtype=torch.float64)  # ill-conditioned inputs
    return [(torch.randn(rows, 6, dtype=torch.float64) * scales,
             torch.randn(rows, 3, dtype=torch.float64)) for _ in range(steps)]


def test_direction_is_the_kronecker_formula():
    layer = nn.Linear(4, 3, dtype=torch.float64)
    x, target = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    kfac = KFAC([layer], damping=0.1)
    out = layer(x)
    ((out - target) ** 2).mean().backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    kfac_step(kfac, 0)
    a = torch.cat([x, torch.ones(10, 1, dtype=torch.float64)], dim=1)
    g = 2 * (out.detach() - target) / 30 * 10  # dL/dy, times N
    eye = torch.eye
    expected = torch.linalg.inv(g.T @ g / 10 + 0.1 * eye(3, dtype=torch.float64)) @ grad \
        @ torch.linalg.inv(a.T @ a / 10 + 0.1 * eye(5, dtype=torch.float64))
    assert torch.allclose(layer.weight.grad, expected[:, :4], rtol=1e-10)
    assert torch.allclose(layer.bias.grad, expected[:, 4], rtol=1e-10)


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="damping"):
        KFAC([nn.Linear(2, 2)], damping=0)
    with pytest.raises(ValueError, match="no.*Linear|none"):
        KFAC([nn.Tanh()])
    with pytest.raises(RuntimeError, match="no curvature yet"):
        KFAC([nn.Linear(2, 2)]).precondition()
    with pytest.raises(ValueError, match="every"):
        kfac_step(KFAC([nn.Linear(2, 2)]), 1, every=0)
    with pytest.raises(ValueError, match="optimizer"):
        kfac_one_process(_model(), _batches(1), lr=0.1, optimizer="lbfgs")


def test_budgets_are_where_the_simulated_ranks_wait():
    plan = schedule("1f1b", 2, 4)
    costs = {"F": [1.0, 1.2], "B": [2.0, 2.6], "overhead": 0.01}
    budgets = bubble_budgets(plan, costs)
    timeline = simulate(plan, costs)
    for r in range(2):
        waited = sum(e.duration for e in timeline.for_rank(r) if e.kind == "recv")
        assert sum(budgets[r].values()) == pytest.approx(waited) and waited > 0
        assert all(plan.actions[r][i].kind.startswith("RECV") for i in budgets[r])


CASES = [("sgd", False, 1), ("adam", False, 1), ("kfac", False, 1), ("kfac", True, 1),
         ("kfac", True, 2)]


def _pipefisher_runs():
    batches = _batches(steps=5)
    return {case: train_pipefisher(_model, batches, "1f1b", 4, lr=0.05, optimizer=case[0],
                                   fill=case[1], damping=0.1, every=case[2]) for case in CASES}


def test_pipelined_kfac_equals_one_process_with_or_without_bubble_filling(cluster2):
    runs = cluster2.run(_pipefisher_runs)
    for (optimizer, fill, every), (first, last) in ((key, (runs[0][key], runs[1][key]))
                                                    for key in CASES):
        losses, params = kfac_one_process(_model(), _batches(steps=5), lr=0.05, damping=0.1,
                                          optimizer=optimizer, every=every)
        assert max(p.abs().max().item() for p in params) < 10  # a stable run, not chaos
        assert last["losses"] == pytest.approx(losses, rel=1e-10), (optimizer, fill, every)
        got = first["parameters"] + last["parameters"]
        assert len(got) == len(params)
        for g, p in zip(got, params, strict=True):
            assert torch.allclose(g, p, rtol=1e-9, atol=1e-12), (optimizer, fill, every)
    for case in CASES[3:]:
        filled = runs[0][case]["units_in_bubbles"] + runs[1][case]["units_in_bubbles"]
        assert filled > 0, case  # some curvature work really ran in the bubbles
    assert runs[0][CASES[2]]["units_in_bubbles"] == 0
    every_other = kfac_one_process(_model(), _batches(steps=5), lr=0.05, damping=0.1,
                                   every=2)[0]
    assert every_other != kfac_one_process(_model(), _batches(steps=5), lr=0.05, damping=0.1)[0]
