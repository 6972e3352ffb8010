"""Balancing a mixture's experts while training (moe/balance.py): the loss-free bias
steers the choice only, the auxiliary loss's gradient is Switch's, and both, composed
over dp and ep (and a pipeline), train exactly as one process in float64; every step's
loads are logged."""

import json
import math
from dataclasses import replace

import pytest
import torch
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)
from test_train_composed import _assert_same_run

import minipar
from minipar.moe.balance import BiasedDropless, LoadBalance
from minipar.moe.routing import route
from minipar.train.loop import train

pytestmark = pytest.mark.slow  # trainer jobs with experts over dp and ep


def test_the_bias_steers_which_experts_are_chosen_not_their_weights():
    torch.manual_seed(0)
    logits = torch.randn(32, 4)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 pulled into every token's top 2
    routing = BiasedDropless(2, bias).route(logits)
    assert (routing.expert == 3).any(1).all()
    probs = logits.softmax(-1)
    assert torch.equal(routing.weight, probs.gather(1, routing.expert))  # unbiased weights
    plain = route(logits, 2, 2.0)
    assert not (plain.expert == 3).any(1).all()


def test_the_auxiliary_losss_gradient_is_switchs():
    """On one process, token weight 1/T: the gradient it injects equals that of routing.py's
    balance loss E sum_i f_i P_i (the lessons' MoE layer), times the coefficient."""
    torch.manual_seed(1)
    logits = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    balance = LoadBalance(4, "aux", coef=0.5)
    balance.token_weight = 1 / 40
    y = torch.zeros(40, 3, dtype=torch.float64, requires_grad=True)
    out = balance.after_routing(route(logits, 2, 2.0), y)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (switch,) = torch.autograd.grad(0.5 * route(logits, 2, 2.0).balance_loss, logits)
    # routing.py counts its shares in float32: equal to float32's rounding
    assert torch.allclose(grad, switch, rtol=1e-6, atol=1e-12)
    assert balance.load.sum() == 80  # 40 tokens x 2 choices counted
    with torch.no_grad():  # evaluation: nothing counted, nothing attached
        balance.after_routing(route(logits, 2, 2.0), y)
    assert balance.load.sum() == 80
    balance.end_step(torch.tensor([30.0, 10.0, 20.0, 20.0], dtype=torch.float64))
    assert balance.load.sum() == 0 and not balance.bias.any()  # "aux" has no bias
    steered = LoadBalance(4, "bias", rate=0.1)
    steered.end_step(torch.tensor([30.0, 10.0, 20.0, 20.0], dtype=torch.float64))
    assert steered.bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])  # sign(mean - load)


def _balanced(config, kind):
    """Four experts, the given balance, one chunk per step (the auxiliary loss's counts are
    per micro-batch: one process's chunk must be the union of the ranks')."""
    model = replace(config.model, experts=4, balance=kind, bias_rate=0.01)
    return replace(config, model=model, train=replace(config.train, accumulation=1))


@pytest.fixture(scope="module")
def one_process_balanced(corpus):  # noqa: F811
    return {kind: minipar.launch(train, 1, _balanced(tiny(corpus), kind), None, True)[0]
            for kind in ("none", "aux", "bias")}


@pytest.mark.parametrize("kind", ["aux", "bias"])
def test_balancing_over_dp_and_ep_trains_as_one_process(cluster2, corpus, kind,  # noqa: F811
                                                        one_process_balanced):
    config = _balanced(tiny(corpus, dp=2, ep=2), kind)
    runs = cluster2.run(train, config, None, True)
    _assert_same_run(runs, one_process_balanced[kind], config)
    plain = one_process_balanced["none"].records
    # the balance really acts: the run is another run than the unbalanced one
    assert any(not math.isclose(a["loss"], b["loss"], rel_tol=1e-6)
               for a, b in zip(runs[0].records, plain, strict=True))
    for mine, theirs in zip(runs[0].records, one_process_balanced[kind].records, strict=True):
        assert mine["expert_load"] == theirs["expert_load"]  # the global batch's counts


def test_the_auxiliary_loss_crosses_a_pipeline_with_zero(cluster4, corpus,  # noqa: F811
                                                         one_process_balanced):
    """pp=2 x dp2 (ep2) with ZeRO-1: the loss lives on the last stage, the first stage's
    auxiliary gradient enters through its block's output."""
    config = _balanced(tiny(corpus, pp=2, dp=2, ep=2, zero=1), "aux")
    _assert_same_run(cluster4.run(train, config, None, True), one_process_balanced["aux"],
                     config)


def test_every_steps_loads_are_logged(corpus, tmp_path):  # noqa: F811
    config = _balanced(tiny(corpus), "none")
    minipar.launch(train, 1, config, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "expert_load" in r]
    assert logged
    tokens = config.train.batch_size * config.model.seq_len
    for r in logged:
        assert len(r["expert_load"]) == config.model.layers
        assert all(sum(block) == config.model.top_k * tokens for block in r["expert_load"])


def test_a_resumed_run_keeps_the_bias(corpus, tmp_path):  # noqa: F811
    """The loss-free bias is state outside the parameters: the checkpoint carries it, so a
    run stopped and resumed equals the run that went straight through."""
    config = _balanced(tiny(corpus), "bias")
    straight = minipar.launch(train, 1, config, tmp_path / "straight")[0]
    minipar.launch(train, 1, config, tmp_path / "stopped", False, False, 10)
    resumed = minipar.launch(train, 1, config, tmp_path / "stopped", False, True)[0]
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in straight.records[10:]]
