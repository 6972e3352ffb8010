"""Dropless and expert-choice MoE equal their per-token / per-expert loops."""

import torch

from minipar.moe import DroplessMoE, ExpertChoiceMoE, MoELayer, padding_waste

HIDDEN, TOKENS, EXPERTS = 8, 24, 4


def _x(seed=0):
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _layer(cls, **kw):
    return cls(HIDDEN, 16, EXPERTS, k=2, capacity_factor=1.0, shared_expert=True, seed=3,
               dtype=torch.float64, **kw)


def _loop(layer, x, routing):
    return torch.stack([sum(routing.weight[t, j] * layer.experts[int(routing.expert[t, j])](x[t])
                            for j in range(2)) + layer.shared(x[t]) for t in range(TOKENS)])


def test_dropless_equals_a_per_token_loop_and_drops_nothing():
    layer, x = _layer(DroplessMoE), _x()
    y = layer(x)
    r = layer.last_routing
    assert r.drop_rate == 0.0 and sum(layer.last_groups) == 2 * TOKENS
    y.pow(2).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer(x)  # a fresh routing graph for the loop (the first one was freed by backward)
    want = _loop(layer, x, layer.last_routing)
    assert torch.allclose(y, want)
    want.pow(2).sum().backward()
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, layer.parameters(), strict=True))
    capped = _layer(MoELayer)  # the same weights with capacity factor 1.0: choices drop
    capped(x)
    assert capped.last_routing.drop_rate > 0


def test_padding_waste_capacity_vs_dropless():
    layer, capped, x = _layer(DroplessMoE), _layer(MoELayer), _x(1)
    layer(x)
    capped(x)
    groups, capacity = layer.last_groups, capped.last_routing.capacity
    padded = padding_waste(groups, capacity=capacity)
    assert padded["computed_rows"] == EXPERTS * capacity
    assert padded["dropped"] == sum(max(g - capacity, 0) for g in groups) > 0
    assert padded["dropped"] == int((~capped.last_routing.kept).sum())  # as the layer drops
    exact = padding_waste(groups)
    assert exact["waste"] == 0 and exact["dropped"] == 0 and exact["used_rows"] == 2 * TOKENS
    blocks = padding_waste(groups, block=8)
    assert blocks["computed_rows"] % 8 == 0 and blocks["computed_rows"] >= 2 * TOKENS


def test_expert_choice_gives_every_expert_the_same_load():
    layer, x = _layer(ExpertChoiceMoE), _x(2)
    y = layer(x)
    picks = layer.last_picks
    assert picks.shape == (EXPERTS, 12)  # C = k * T / E = 12 tokens per expert
    probs = layer.gate(x).softmax(-1)
    want = layer.shared(x).clone()
    for e in range(EXPERTS):
        for t in picks[e].tolist():
            want[t] += probs[t, e] * layer.experts[e](x[t])
    assert torch.allclose(y, want)
    per_token = layer.experts_per_token()
    assert per_token.sum() == EXPERTS * 12 and per_token.shape == (TOKENS,)
    chosen = {e: set(picks[e].tolist()) for e in range(EXPERTS)}
    for e in range(EXPERTS):  # every pick beats every token the expert left out
        left_out = [t for t in range(TOKENS) if t not in chosen[e]]
        assert probs[picks[e], e].min() >= probs[left_out, e].max()


def _dropless_ep():
    import minipar
    from minipar.moe import ExpertParallelMoE

    k, me = minipar.world_size(), minipar.rank()
    twin = _layer(DroplessMoE)
    x_all = _x(5)
    layer = ExpertParallelMoE(twin)
    y = layer(x_all.chunk(k)[me])
    y.pow(2).sum().backward()
    want = twin(x_all)
    want.pow(2).sum().backward()  # each expert's gradient: every rank's tokens, summed
    twin_params = dict(twin.named_parameters())
    first = me * layer.per_rank
    wrong = []
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            index, rest = name.split(".", 2)[1:]
            if not torch.allclose(p.grad, twin_params[f"experts.{first + int(index)}.{rest}"].grad):
                wrong.append(name)
    return (bool(torch.allclose(y, want.chunk(k)[me])), layer.last_routing.drop_rate, wrong)


def test_dropless_expert_parallelism_equals_the_one_process_dropless_layer(cluster2, cluster4):
    for cluster in (cluster2, cluster4):
        for same, drops, wrong in cluster.run(_dropless_ep):
            assert same and drops == 0.0 and wrong == []
