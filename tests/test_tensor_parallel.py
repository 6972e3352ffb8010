"""Column- and row-parallel linear layers equal their single-process twin (output and every
gradient, float64) for TP = 1, 2, 4; sizes that do not split are refused. The decoder's
parallel attention, SwiGLU and block are tested in test_tensor_parallel_block.py."""

import pytest
import torch
from conftest import value_errors

import minipar
from minipar import tensor_parallel as tp
from minipar.decoder import SwiGLU

S, B, H, FFN = 8, 2, 8, 16


def _x(seed=0):
    return torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _shard_rows(t):  # a column-parallel weight's shard: its output features
    return t.chunk(minipar.world_size(), 0)[minipar.rank()]


def _shard_cols(t):
    return t.chunk(minipar.world_size(), -1)[minipar.rank()]


def _check_linear_layers():
    torch.manual_seed(1)
    twin = torch.nn.Linear(H, FFN, dtype=torch.float64)
    x = _x().requires_grad_(True)
    out = twin(x)
    (out ** 2).sum().backward()
    report = {}
    col = tp.ColumnParallelLinear.from_linear(twin, gather_output=True)
    x1 = _x().requires_grad_(True)
    y = col(x1)
    (y ** 2).sum().backward()
    report["column"] = (torch.allclose(y, out), torch.allclose(x1.grad, x.grad),
                        torch.allclose(col.weight.grad, _shard_rows(twin.weight.grad)),
                        torch.allclose(col.bias.grad, _shard_rows(twin.bias.grad)))
    row = tp.RowParallelLinear.from_linear(twin)
    x2 = _x().requires_grad_(True)
    y = row(x2)
    (y ** 2).sum().backward()
    report["row"] = (torch.allclose(y, out), torch.allclose(x2.grad, x.grad),
                     torch.allclose(row.weight.grad, _shard_cols(twin.weight.grad)),
                     torch.allclose(row.bias.grad, twin.bias.grad))
    return report


def _all_checks():
    return {"linear": _check_linear_layers()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_linear_layers_equal_their_twins(world_size):
    for r, results in enumerate(minipar.launch(_all_checks, world_size, backend="gloo",
                                               timeout=90)):
        assert all(all(v) for v in results["linear"].values()), (r, results["linear"])


def test_sizes_that_do_not_divide_are_refused(cluster4):
    def attempt():
        return value_errors(lambda: tp.ColumnParallelLinear(8, 6),
                            lambda: tp.RowParallelLinear(6, 8),
                            lambda: tp.ParallelSwiGLU(SwiGLU(8, 6)))

    errors = cluster4.run(attempt)[0]
    assert "out_features=6 is not divisible by the tensor-parallel size 4" in errors[0]
    assert "in_features=6 is not divisible" in errors[1]
    assert "out_features=6 is not divisible" in errors[2]  # SwiGLU's gate: its width
