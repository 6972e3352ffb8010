"""MoE routing pinned by hand-derived fixtures; MoELayer equals a per-token reference."""

import pytest
import torch

from minipar import moe


def test_four_by_four_top2_capacity2_assignment():
    logits = torch.tensor([[4.0, 3, 0, 0],   # token 0: experts 0 then 1
                           [4.0, 0, 3, 0],   # token 1: 0 then 2
                           [4.0, 3, 0, 0],   # token 2: 0 then 1
                           [0.0, 4, 3, 0]])  # token 3: 1 then 2
    r = moe.route(logits, k=2, capacity_factor=1.0)
    assert r.capacity == 2  # ceil(2 * 4 / 4 * 1.0)
    # first choices in token order fill expert 0 (tokens 0, 1) and drop token 2's; then
    # second choices: token 0 -> expert 1 slot 1 (token 3's first choice took slot 0),
    # token 1 -> expert 2 slot 0, token 2 -> expert 1 (full: dropped), token 3 -> expert 2 slot 1
    assert r.expert.tolist() == [[0, 1], [0, 2], [0, 1], [1, 2]]
    assert r.slot.tolist() == [[0, 1], [1, 0], [-1, -1], [0, 1]]
    assert r.weight[2].tolist() == [0.0, 0.0] and r.drop_rate == pytest.approx(2 / 8)
    assert r.load(4).tolist() == [2, 2, 2, 0]
    assert r.routed(4).tolist() == [3, 3, 2, 0]  # before capacity: token 2's two choices too


def test_when_everyone_prefers_one_expert_the_first_capacity_tokens_stay():
    logits = torch.tensor([[5.0, 0, 1]] * 6)
    r = moe.route(logits, k=1, capacity_factor=1.0)
    assert r.capacity == 2
    assert r.slot[:, 0].tolist() == [0, 1, -1, -1, -1, -1]


def test_gate_orders_and_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    probs = logits.softmax(-1)[0]
    plain = moe.route(logits, 2, capacity_factor=4, order="softmax_topk")
    assert plain.weight[0].tolist() == pytest.approx(probs[:2].tolist())
    renorm = moe.route(logits, 2, capacity_factor=4, renormalize=True)
    assert renorm.weight.sum().item() == pytest.approx(1.0)
    after = moe.route(logits, 2, capacity_factor=4, order="topk_softmax")
    assert after.weight[0].tolist() == pytest.approx(torch.tensor([2.0, 1.0]).softmax(-1).tolist())


def test_balance_loss_is_one_under_uniform_routing_and_more_when_skewed():
    uniform = torch.eye(4).repeat(2, 1) * 3  # each expert the top choice of 2 of 8 tokens
    assert moe.route(uniform, 1, capacity_factor=2).balance_loss.item() == pytest.approx(1.0)
    skewed = torch.tensor([[3.0, 0, 0, 0]] * 8)
    assert moe.route(skewed, 1, capacity_factor=2).balance_loss.item() > 2.0
    assert moe.route(skewed, 1).z_loss.item() == pytest.approx(
        torch.logsumexp(skewed[0], 0).item() ** 2)


def test_an_identity_expert_returns_its_input():
    x = torch.randn(5, 3)
    r = moe.route(torch.randn(5, 2), k=1, capacity_factor=10, order="topk_softmax")
    assert torch.allclose(moe.dispatch_combine(x, r, [torch.nn.Identity()] * 2), x)


def _per_token_reference(layer, x):
    """The definition, one token at a time: sum of kept weights x expert outputs."""
    r = layer.last_routing
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for j in range(layer.rule.k):
            if r.slot[t, j] >= 0:
                y = y + r.weight[t, j] * layer.experts[int(r.expert[t, j])](x[t])
        rows.append(y + (layer.shared(x[t]) if layer.shared is not None else 0))
    return torch.stack(rows)


@pytest.mark.parametrize("shared", [False, True])
def test_moe_layer_equals_the_per_token_definition(shared):
    layer = moe.MoELayer(6, 12, num_experts=4, k=2, capacity_factor=0.75, shared_expert=shared,
                         seed=1, dtype=torch.float64)
    x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    assert layer.last_routing.drop_rate > 0  # capacity 0.75: some tokens really drop
    reference = _per_token_reference(layer, x)
    assert torch.allclose(out, reference, rtol=1e-12)
    grads = torch.autograd.grad(out.sum(), list(layer.parameters()), allow_unused=True,
                                retain_graph=True)
    ref_grads = torch.autograd.grad(reference.sum(), list(layer.parameters()), allow_unused=True)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert (g is None) == (ref is None)
        if g is not None:
            assert torch.allclose(g, ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("call, words", [
    (lambda: moe.route(torch.zeros(2, 3), k=4), "k must be an int from 1 to the number of"),
    (lambda: moe.route(torch.zeros(2, 3), k=0), "k must be an int from 1"),
    (lambda: moe.route(torch.zeros(2, 3), k=1, capacity_factor=0), "capacity_factor must be"),
    (lambda: moe.MoELayer(4, 8, 2)(torch.zeros(3, 5)), "x must be \\[tokens, 4\\]"),
    (lambda: moe.route(torch.zeros(2, 3), k=1, order="random"), "order must be one of"),
])
def test_bad_input_says_what_to_change(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def _skewed_layer(noisy):
    layer = moe.MoELayer(8, 16, num_experts=4, k=1, capacity_factor=1.0, noisy=noisy, seed=5)
    with torch.no_grad():  # a router that sends almost everything to expert 0
        layer.gate.router.weight.zero_()
        layer.gate.router.weight[0] = 0.5
        if noisy:
            layer.gate.noise.weight.fill_(2.0)
    return layer


def test_noise_spreads_a_skewed_router_and_the_balance_loss_fixes_it():
    torch.manual_seed(0)
    x = torch.rand(64, 8)  # positive inputs: expert 0's logit is the largest
    plain, noisy = _skewed_layer(False), _skewed_layer(True)
    plain(x)
    noisy(x)
    assert moe.imbalance(plain.last_routing.load(4)) > 1.9  # one expert takes its capacity
    assert plain.last_routing.drop_rate > 0.7
    assert moe.imbalance(noisy.last_routing.load(4)) < \
        moe.imbalance(plain.last_routing.load(4))
    assert noisy.last_routing.drop_rate < plain.last_routing.drop_rate
    history = moe.train_router_stats(_skewed_layer(False), x, torch.zeros(64, 8), steps=60,
                                     lr=0.5, balance_weight=1.0)
    assert history[-1]["balance_loss"] < history[0]["balance_loss"]
    assert history[-1]["drop_rate"] < history[0]["drop_rate"]
