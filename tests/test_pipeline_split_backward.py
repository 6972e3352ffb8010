"""The zero-bubble split (pipeline/split_backward.py, Stage.backward_input/_weight): I then
W give the gradients one backward gives, in float64, for blocks, a weight used twice, a
scale joining at the output and a weight left unused; W does not walk the activations'
path again; a stage whose output ignores its input falls back to a plain backward."""

import torch
from torch import nn

from minipar.pipeline.split_backward import Junctions
from minipar.pipeline.stage import Stage


class Shared(nn.Module):
    """Two blocks, the second using one matrix twice (as a tied weight is used) with a
    scale's junction between the two uses, and a spare layer no micro-batch uses (as an
    expert no token chose)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.twice = nn.Linear(6, 6, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.spare = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.twice(self.scale * torch.tanh(self.twice(h)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Shared().double()


def _one_backward(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad_out)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return x.grad, grads


def test_input_then_weight_gradients_equal_one_backward():
    model = _model()
    x, grad_out = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    want_x, want = _one_backward(model, x, grad_out)
    stage = Stage(model, 1)
    leaf = x.clone().requires_grad_()
    out = stage.forward(leaf, 0)
    got_x = stage.backward_input(0, out, grad_out, leaf)
    assert all(p.grad is None for p in model.parameters())  # I computes no weight gradient
    assert 0 in stage.junctions
    stage.backward_weight(0, out, grad_out)
    got = [p.grad for p in model.parameters()]
    torch.testing.assert_close(got_x, want_x, rtol=1e-14, atol=1e-14)
    assert got[-2:] == [None, None] and want[-2:] == [None, None]  # the spare layer, unused
    for a, b in zip(got[:-2], want[:-2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    assert not stage.junctions  # W took what I kept


def test_weight_pass_does_not_walk_the_activations_path_again():
    """The first block's Tanh lies on the input's path only, below every other weight's
    junction: I goes through it, W must not (from the output, as a plain backward does,
    it would)."""
    model = _model()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    h = model.first(x)
    out = model.twice(model.scale * torch.tanh(model.twice(h)))  # Shared.forward, opened
    tanh = h.grad_fn
    calls = []
    tanh.register_prehook(lambda grads: calls.append(1))
    junctions = Junctions(out, x, [p for p in model.parameters() if p.requires_grad])
    with junctions.keep():
        torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)
    assert calls == [1]
    junctions.weights_backward()
    assert calls == [1]
    assert all(p.grad is not None for n, p in model.named_parameters() if "spare" not in n)


def test_an_output_that_ignores_its_input_has_no_junctions():
    """Nothing joins the input's path there: W must walk from the output (Stage does)."""
    model = _model()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out = model(torch.randn(4, 6, dtype=torch.float64))
    assert not Junctions(out, x, list(model.parameters())).found
