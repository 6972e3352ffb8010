"""Tensor-parallel layers and blocks equal their single-process twins (output and every
gradient, float64, rtol 1e-10) for TP = 1, 2, 4, with Megatron's communication counts."""

import pytest
import torch
from conftest import value_errors

import minipar
from minipar import collectives, models
from minipar import tensor_parallel as tp

S, B, H, HEADS, FFN = 8, 2, 8, 4, 16


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


def _check_block(kind, sequence_parallel=False):
    torch.manual_seed(2)
    if kind == "mlp":
        twin = models.FFN(H, FFN, torch.float64)
        par = tp.ParallelMLP(twin, sequence_parallel=sequence_parallel)
    elif kind == "attention":
        twin = models.SelfAttention(H, HEADS, torch.float64)
        par = tp.ParallelSelfAttention(twin, sequence_parallel=sequence_parallel)
    else:
        twin = models.TransformerBlock(H, HEADS, FFN, seed=3, dtype=torch.float64)
        par = tp.ParallelTransformerBlock(twin, sequence_parallel=sequence_parallel)
    x = _x(4).requires_grad_(True)
    out = twin(x)
    (out.sin()).sum().backward()
    x_par = _x(4)
    if sequence_parallel:
        x_par = x_par.chunk(minipar.world_size(), 0)[minipar.rank()].contiguous()
    x_par.requires_grad_(True)
    with collectives.meter() as m:
        y = par(x_par)
        forward_calls = dict(m.calls)
        y.sin().sum().backward()
    if sequence_parallel:
        tp.sync_sequence_parallel_grads(par)
    want_out = out.chunk(minipar.world_size(), 0)[minipar.rank()] if sequence_parallel else out
    want_xg = x.grad.chunk(minipar.world_size(), 0)[minipar.rank()] if sequence_parallel \
        else x.grad
    problems = []
    if not torch.allclose(y, want_out, rtol=1e-10, atol=1e-12):
        problems.append("output")
    if not torch.allclose(x_par.grad, want_xg, rtol=1e-10, atol=1e-12):
        problems.append("input grad")
    twin_params = dict(twin.named_parameters())
    for name, p in par.named_parameters():
        ref = twin_params[name].grad
        if p.shape != ref.shape:  # a shard: find which dim was split
            dim = 0 if p.shape[0] != ref.shape[0] else p.dim() - 1
            ref = ref.chunk(minipar.world_size(), dim)[minipar.rank()]
        if not torch.allclose(p.grad, ref, rtol=1e-10, atol=1e-12):
            problems.append(name)
    backward_calls = {k: m.calls.get(k, 0) - forward_calls.get(k, 0) for k in m.calls}
    return problems, forward_calls, backward_calls


def _all_checks():
    results = {"linear": _check_linear_layers()}
    for kind in ("mlp", "attention", "block"):
        results[kind] = _check_block(kind)
        results[kind + "-sp"] = _check_block(kind, sequence_parallel=True)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_layers_and_blocks_equal_their_twins(world_size):
    for r, results in enumerate(minipar.launch(_all_checks, world_size, backend="gloo",
                                               timeout=90)):
        assert all(all(v) for v in results["linear"].values()), (r, results["linear"])
        for kind in ("mlp", "attention", "block", "mlp-sp", "attention-sp", "block-sp"):
            problems, _, _ = results[kind]
            assert problems == [], (world_size, r, kind, problems)
        if world_size > 1:
            for kind in ("mlp", "attention"):
                _, fwd, bwd = results[kind]  # Megatron: one all-reduce each way per block
                assert fwd == {"all_reduce": 1}, (kind, fwd)
                assert {k: v for k, v in bwd.items() if v} == {"all_reduce": 1}, (kind, bwd)
                _, fwd, bwd = results[kind + "-sp"]  # sequence parallel: same volume, split
                assert fwd == {"all_gather": 1, "reduce_scatter": 1}, (kind, fwd)
                assert {k: v for k, v in bwd.items() if v} == {"all_gather": 1,
                                                              "reduce_scatter": 1}, (kind, bwd)


def test_sizes_that_do_not_divide_are_refused(cluster4):
    def attempt():
        return value_errors(lambda: tp.ColumnParallelLinear(8, 6),
                            lambda: tp.RowParallelLinear(6, 8),
                            lambda: tp.ParallelSelfAttention(models.SelfAttention(12, 6)))

    errors = cluster4.run(attempt)[0]
    assert "out_features=6 is not divisible by the tensor-parallel size 4" in errors[0]
    assert "in_features=6 is not divisible" in errors[1]
    assert "heads=6 is not divisible" in errors[2]


def _gpt_check():
    twin = models.TinyGPT(vocab=32, hidden=16, heads=4, layers=2, seq_len=8, seed=5,
                      dtype=torch.float64)
    gpt = tp.ParallelTinyGPT(twin)
    ids = torch.randint(0, 32, (8, 2), generator=torch.Generator().manual_seed(6))
    targets = torch.randint(0, 32, (8, 2), generator=torch.Generator().manual_seed(7))

    def loss_of(model):
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))

    reference, loss = loss_of(twin), loss_of(gpt)
    reference.backward()
    loss.backward()
    twin_params = dict(twin.named_parameters())
    wrong = []
    for name, p in gpt.named_parameters():
        ref = twin_params[name].grad
        if p.shape != ref.shape:
            dim = 0 if p.shape[0] != ref.shape[0] else p.dim() - 1
            ref = ref.chunk(minipar.world_size(), dim)[minipar.rank()]
        if not torch.allclose(p.grad, ref, rtol=1e-10, atol=1e-12):
            wrong.append(name)
    return abs(loss.item() - reference.item()), wrong


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_gpt_equals_its_twin(world_size):
    for gap, wrong in minipar.launch(_gpt_check, world_size, backend="gloo", timeout=60):
        assert gap < 1e-12 and wrong == []
