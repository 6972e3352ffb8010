"""Expert parallelism equals the one-process MoELayer: outputs, capacity drops and
gradients, for EP = 1, 2, 4."""

import pytest
import torch
from conftest import value_errors

import minipar
from minipar import collectives
from minipar.moe import ChunkedAllToAll, ExpertParallelMoE, MoELayer

TOKENS_PER_RANK = 6


def _twin(shared=False):
    return MoELayer(8, 16, num_experts=4, k=2, capacity_factor=0.75, shared_expert=shared,
                    seed=3, dtype=torch.float64)


def _all_tokens(world):
    return torch.randn(world * TOKENS_PER_RANK, 8, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(4))


def _ep_run(shared):
    k, me = minipar.world_size(), minipar.rank()
    layer = ExpertParallelMoE(_twin(shared))
    x = _all_tokens(k)[me * TOKENS_PER_RANK:(me + 1) * TOKENS_PER_RANK]
    y = layer(x)
    y.pow(2).sum().backward()
    for p in layer.gate.parameters():  # the replicated gate: sum each rank's share
        collectives.all_reduce(p.grad)
    if layer.shared is not None:
        for p in layer.shared.parameters():
            collectives.all_reduce(p.grad)
    return (y.detach(), layer.last_routing.slot, {n: p.grad for n, p in layer.named_parameters()},
            layer.tokens_received)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("shared", [False, True])
def test_equals_the_one_process_layer(world_size, shared):
    results = minipar.launch(_ep_run, world_size, shared, backend="gloo", timeout=60)
    twin = _twin(shared)
    x = _all_tokens(world_size)
    y = twin(x)
    y.pow(2).sum().backward()
    assert twin.last_routing.drop_rate > 0  # drops happen, and must match
    per_rank = 4 // world_size
    for r, (out, slot, grads, received) in enumerate(results):
        rows = slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK)
        assert torch.allclose(out, y[rows].detach(), rtol=1e-12), r
        assert torch.equal(slot, twin.last_routing.slot[rows]), r
        twin_grads = dict(twin.named_parameters())
        for name, g in grads.items():
            if name.startswith("experts."):
                index, rest = name.split(".", 2)[1:]
                ref = twin_grads[f"experts.{int(index) + r * per_rank}.{rest}"].grad
            else:
                ref = twin_grads[name].grad
            assert torch.allclose(g, ref, rtol=1e-10, atol=1e-14), (r, name)
        assert received == int(twin.last_routing.load(4)[r * per_rank:(r + 1) * per_rank].sum())


def test_experts_must_divide_among_ranks(cluster4):
    def attempt():
        return value_errors(lambda: ExpertParallelMoE(MoELayer(4, 8, num_experts=6, k=1)))[0]

    assert "6 experts cannot be split evenly over 4 ranks" in cluster4.run(attempt)[0]


def _rows_computed():
    x = _all_tokens(4)[minipar.rank() * TOKENS_PER_RANK:(minipar.rank() + 1) * TOKENS_PER_RANK]
    flat = ExpertParallelMoE(_twin())
    chunked = ExpertParallelMoE(_twin(), exchange=ChunkedAllToAll(1))
    flat(x)
    chunked(x)
    return (flat.rows_computed, flat.tokens_received, flat.last_routing.capacity,
            chunked.rows_computed, chunked.tokens_received)


def test_rows_computed_counts_the_capacity_buffer_only_where_it_is_filled(cluster4):
    """The flat exchange fills the twin's capacity buffer (its empty slots computed too);
    the chunked one runs the experts on the rows that came."""
    for flat, received, capacity, chunked, chunked_received in cluster4.run(_rows_computed):
        assert flat == 1 * capacity  # one expert per rank
        assert received <= flat
        assert chunked == chunked_received == received
