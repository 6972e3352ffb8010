"""Pipeline MoE (experts in a tensor-parallel group) equals the one-process layer."""

import pytest
import torch
from conftest import grad_mismatches

from minipar import collectives
from minipar.moe import MoELayer
from minipar.moe.pipeline_moe import PipelineMoE
from minipar.runtime import rank


def _twin():
    return MoELayer(8, 16, num_experts=4, k=2, capacity_factor=1.0, shared_expert=True,
                    seed=9, dtype=torch.float64)


def _on_rank():
    twin = _twin()
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    w = torch.randn(20, 8, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    layer = PipelineMoE(twin)
    mine = x.clone().requires_grad_()
    with collectives.meter() as m:
        y = layer(mine)
        (y * w).sum().backward()
    ref_x = x.clone().requires_grad_()
    (twin(ref_x) * w).sum().backward()
    for p in layer.replicated_parameters():  # each rank holds its share: sum them
        p.grad = collectives.all_reduce(p.grad if p.grad is not None else torch.zeros_like(p))
    wrong = grad_mismatches(layer, twin, layer.first)
    return {"output": torch.allclose(y, twin(x), rtol=1e-10, atol=1e-12),
            "input_grad": torch.allclose(mine.grad, ref_x.grad, rtol=1e-10, atol=1e-12),
            "wrong": wrong, "rows": layer.rows_computed, "calls": dict(m.calls),
            "kept": int(twin.last_routing.kept.sum()), "rank": rank()}


@pytest.mark.parametrize("ranks", [2, 4])
def test_pipeline_moe_equals_one_process(ranks, cluster2, cluster4):
    results = (cluster2 if ranks == 2 else cluster4).run(_on_rank)
    for r in results:
        assert r["output"] and r["input_grad"] and r["wrong"] == [], r
        # forward: one all-reduce; backward: f's all-reduce of the input gradient; no all-to-all
        assert "all_to_all" not in r["calls"]
    assert sum(r["rows"] for r in results) == results[0]["kept"]  # each kept choice once


def _three_experts_on_two_ranks():
    try:
        PipelineMoE(MoELayer(8, 16, num_experts=3, k=1))
    except ValueError as error:
        return str(error)


def test_pipeline_moe_refuses_experts_that_do_not_split(cluster2):
    assert all("3 experts cannot be split evenly over 2 ranks" in e
               for e in cluster2.run(_three_experts_on_two_ranks))
