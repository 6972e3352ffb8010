"""Tutel's adaptive parallelism: every degree equals the one-process layer from the same
stored shards; what each degree sends; the cost model's crossover."""

import pytest
import torch

import minipar
from minipar import collectives
from minipar.moe import MoELayer
from minipar.moe.adaptive import AdaptiveMoE, degree_costs, valid_degrees

TOKENS_PER_RANK = 6


def _twin(experts, k):
    return MoELayer(8, 16, num_experts=experts, k=k, capacity_factor=1.0, shared_expert=True,
                    seed=5, dtype=torch.float64)


def _all_tokens(world):
    return torch.randn(world * TOKENS_PER_RANK, 8, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(6))


def _on_rank(experts, k):
    size, me = minipar.world_size(), minipar.rank()
    twin = _twin(experts, k)
    x_all = _all_tokens(size)
    rows = slice(me * TOKENS_PER_RANK, (me + 1) * TOKENS_PER_RANK)
    twin(x_all).pow(2).sum().backward()
    ref_y = twin(x_all).detach()[rows]
    layer = AdaptiveMoE(_twin(experts, k))
    stored = {n: p.detach().clone() for n, p in layer.named_parameters()}
    report = {"degrees": layer.degrees, "bad": [], "traffic": {}}
    for degree in layer.degrees:
        layer.zero_grad()
        x = x_all[rows].clone().requires_grad_()
        y = layer(x, degree)
        y.pow(2).sum().backward()
        for p in [*layer.gate.parameters(), *layer.shared.parameters()]:  # each rank's share
            collectives.all_reduce(p.grad)
        if not torch.allclose(y, ref_y, rtol=1e-10, atol=1e-12):
            report["bad"].append((degree, "output"))
        ref_x = x_all.clone().requires_grad_()
        twin.zero_grad()
        twin(ref_x).pow(2).sum().backward()
        if not torch.allclose(x.grad, ref_x.grad[rows], rtol=1e-10, atol=1e-12):
            report["bad"].append((degree, "input grad"))
        want = layer.twin_slices(twin, grad=True)
        want |= {f"gate.{n}": p.grad for n, p in twin.gate.named_parameters()}
        want |= {f"shared.{n}": p.grad for n, p in twin.shared.named_parameters()}
        for name, p in layer.named_parameters():
            if not torch.allclose(p.grad, want[name], rtol=1e-10, atol=1e-12):
                report["bad"].append((degree, name))
        report["traffic"][degree] = dict(layer.last_traffic)
    report["kept_shards"] = all(torch.equal(p, stored[n]) for n, p in layer.named_parameters())
    y_auto = layer(x_all[rows], "auto")
    report["auto"] = (layer.last_degree, torch.allclose(y_auto, ref_y, rtol=1e-10, atol=1e-12))
    return report


@pytest.mark.parametrize("experts,k", [(4, 2), (2, 2), (1, 1)])
def test_every_degree_equals_one_process(experts, k, cluster4):
    results = cluster4.run(_on_rank, experts, k)
    s = max(4 // experts, 1)
    for r in results:
        assert r["degrees"] == valid_degrees(experts, 4)
        assert r["bad"] == [], r["bad"]
        assert r["kept_shards"]  # running at any degree never rewrote the stored shards
        assert r["traffic"][0]["rows"] == 0  # degree 0: tokens stay
        # degree s moves no weights but the output bias: (s-1) ring steps of 8/s float64s
        assert r["traffic"][s]["weights"] == (s - 1) * (8 // s) * 8, r["traffic"]
        assert r["traffic"][s]["rows"] > 0
        assert r["auto"][1]
    assert len({r["auto"][0] for r in results}) == 1  # every rank picked the same degree


def test_degrees_and_their_errors():
    assert valid_degrees(4, 4) == (0, 1)
    assert valid_degrees(2, 4) == (0, 1, 2)
    assert valid_degrees(1, 8) == (0, 1, 2, 4, 8)
    with pytest.raises(ValueError, match="one must divide the other"):
        valid_degrees(3, 4)


def test_few_rows_keep_the_weights_still_many_rows_move_them():
    shape = dict(hidden=1024, ffn=4096, experts=2, ranks=4, alpha=1e-5, beta=1e-10)
    few = degree_costs(rows=64, **shape)
    many = degree_costs(rows=1 << 20, **shape)
    assert min(few, key=few.get) == 2  # tensor parallel inside the expert
    assert min(many, key=many.get) == 0  # data parallel: gather the experts


def _bad_degree():
    try:
        AdaptiveMoE(_twin(2, 2), degree=3)
    except ValueError as error:
        return str(error)


def test_refuses_a_degree_the_layout_cannot_run(cluster4):
    assert all("degree must be 'auto' or one of (0, 1, 2)" in e
               for e in cluster4.run(_bad_degree))
