"""The engine runs every synchronous schedule on real ranks and equals one process:
the loss and every gradient, float64, rtol 1e-10."""

import pytest
import torch

import minipar
from minipar.models import regression_data
from minipar.pipeline import Pipeline, schedule, split_model

SYNC = [("naive", 1, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 3, 1), ("zb_h1", 4, 1),
        ("looped_bfs", 4, 2), ("interleaved_1f1b", 4, 2)]


def _layers(n_stages):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_stages):
        layers += [torch.nn.Linear(6, 6, dtype=torch.float64), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(6, 1, dtype=torch.float64))
    return torch.nn.Sequential(*layers)


def _data():
    return regression_data(10, 6, seed=3, dtype=torch.float64)  # 10: uneven micro-batches


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _reference(n_stages):
    model = _layers(n_stages)
    x, y = _data()
    loss = _mse(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _pipeline_run(cases):
    results = {}
    k = minipar.world_size()
    for name, m, v in cases:
        model = _layers(k * v)
        stages = split_model(model, k * v, boundaries=list(range(2, 2 * k * v, 2)))
        pipe = Pipeline(stages, schedule(name, k, m, v))
        x, y = _data()
        loss = pipe.train_step(x, y, _mse)
        grads = {(s, i): p.grad.clone() for s, mod in pipe.modules.items()
                 for i, p in enumerate(mod.parameters())}
        results[(name, m, v)] = (loss, grads)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_synchronous_schedule_equals_one_process(world_size):
    cases = [c for c in SYNC if not (c[0] == "interleaved_1f1b" and c[1] % world_size)]
    results = minipar.launch(_pipeline_run, world_size, cases, backend="gloo", timeout=120)
    for case in cases:
        n_stages = world_size * case[2]
        ref_loss, ref_grads = _reference(n_stages)
        model = _layers(n_stages)
        stages = split_model(model, n_stages, boundaries=list(range(2, 2 * n_stages, 2)))
        # parameters in model order, located by (stage, index within stage)
        where = [(s, i) for s, mod in enumerate(stages) for i, _ in enumerate(mod.parameters())]
        got = {}
        for r in range(world_size):
            loss, grads = results[r][case]
            if loss is not None:
                assert loss == pytest.approx(ref_loss, rel=1e-12), case
            got.update(grads)
        assert len(got) == len(where), case
        for (s, i), ref in zip(where, ref_grads, strict=True):
            assert torch.allclose(got[(s, i)], ref, rtol=1e-10, atol=1e-14), (case, s, i)


def test_split_model_balances_by_parameters_or_takes_boundaries():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1),
                                torch.nn.Linear(1, 1), torch.nn.Linear(1, 50))  # 110, 11, 2, 100
    stages = split_model(model, 2)
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sizes == [110, 113]  # the split with the smallest largest stage
    assert [len(s) for s in split_model(model, 3, boundaries=[1, 3])] == [1, 2, 1]
    with pytest.raises(ValueError, match="boundaries must be 1 increasing"):
        split_model(model, 2, boundaries=[0])
    with pytest.raises(ValueError, match="stages must be an int from 1 to the number of layers"):
        split_model(model, 5)
