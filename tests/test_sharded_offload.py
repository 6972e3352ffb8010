"""Offloading to the host (swap.py, offload.py), KARMA's plan (karma.py) and ZeRO-Offload
(zero_offload.py): training equals in-memory training exactly, the device stays under its
budget, and a budget too small is one line."""

import pytest
import torch

from minipar.cost import Link
from minipar.models import mse
from minipar.sharded import ZeroDataParallel, karma
from minipar.sharded.memory_tracker import BudgetExceeded, MemoryTracker
from minipar.sharded.offload import Offload, hidden_fraction, timeline_rows
from minipar.sharded.offload_bench import batch, offload_model
from minipar.sharded.zero_offload import host_optimizer
from minipar.trace import capture

WIDTH, BLOCKS, ROWS, STEPS = 48, 6, 16, 3


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _data():
    return batch(ROWS, WIDTH, torch.float64)


def _model():
    return offload_model(WIDTH, BLOCKS, torch.float64, seed=3)


def _vector(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _in_memory() -> torch.Tensor:
    model, (x, y) = _model(), _data()
    opt = _adam(model.parameters())
    for _ in range(STEPS):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    return _vector(model)


def _offloaded(activations, states, prefetch=True, budget=None):
    """Parameters after STEPS offloaded steps, the device peak and the step's timeline."""
    model, (x, y) = _model(), _data()
    off = Offload(model, _adam, activations, states, prefetch=prefetch, budget=budget)
    tracker = off.tracker()
    with capture() as c:
        for _ in range(STEPS):
            with tracker.watch():
                mse(off(x), y).backward()
            off.step()
    off.gather_parameters()
    return _vector(model), tracker.peak().total, c.timeline


@pytest.mark.parametrize("activations, states, prefetch", [
    ("swap", "device", True),  # activation offload
    ("swap", "device", False),
    ("keep", "host", True),  # parameters and optimizer state offload
    ("keep", "host", False),
    (["swap", "recompute", "keep", "recompute", "swap", "keep"], "host", True),  # a KARMA plan
])
def test_offloaded_training_equals_in_memory_exactly(activations, states, prefetch):
    got, _, _ = _offloaded(activations, states, prefetch)
    assert torch.equal(got, _in_memory())


def test_device_peak_stays_under_a_budget_in_memory_training_exceeds():
    model, (x, y) = _model(), _data()
    opt = _adam(model.parameters())
    whole = MemoryTracker(model, opt)
    for _ in range(2):
        with whole.watch():
            mse(model(x), y).backward()
        opt.step()
    budget = whole.peak().total // 2
    with pytest.raises(BudgetExceeded) as err:
        with MemoryTracker(model, opt, budget=budget).watch():
            mse(model(x), y).backward()
    message = str(err.value)
    assert "\n" not in message and "budget" in message and "raise budget=" in message
    got, peak, _ = _offloaded("swap", "host", budget=budget)
    assert peak <= budget
    assert torch.equal(got, _in_memory())


def test_a_budget_too_small_for_one_layer_is_one_line():
    with pytest.raises(ValueError) as err:
        Offload(_model(), _adam, "swap", "host", budget=1000)
    assert "cannot hold one layer" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="states='host'"):
        Offload(_model(), _adam, "keep", "device", budget=20_000)
    for bad in (dict(activations="spill"), dict(activations=["swap"]), dict(states="disk")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Offload(_model(), _adam, **bad)


def test_timeline_rows_show_the_copies_under_compute_with_prefetch_only():
    _, _, prefetched = _offloaded("swap", "host", prefetch=True)
    _, _, serial = _offloaded("swap", "host", prefetch=False)
    rows = timeline_rows(prefetched)
    assert rows.ranks == [0, 2]  # SE-MoE's rows: compute and copy
    assert {e.kind for e in rows.for_rank(2)} == {"copy"}
    assert 0.0 <= hidden_fraction(prefetched) <= 1.0
    assert hidden_fraction(serial) == 0.0  # without prefetch a copy stops the compute


def test_karma_plan_follows_the_cost_model():
    layers = karma.profile(_model(), _data()[0])
    assert len(layers) == BLOCKS and layers[1].flops == 0 and layers[0].flops > 0
    total = sum(p.saved_bytes for p in layers)
    slow_copy, fast_copy = Link(0.0, 1e6), Link(0.0, 1e15)
    compute = karma.Compute(0.0, 1e9)
    # copies a million times slower than compute: recompute wherever it must choose
    plan = karma.plan(layers, slow_copy, compute, total // 2, prefetch=False)
    assert "recompute" in plan.choices and "swap" not in plan.choices
    assert plan.held_bytes() <= total // 2
    slow_compute = karma.Compute(1e-3, 1e9)  # every recomputation costs at least 1 ms
    assert set(karma.plan(layers, fast_copy, slow_compute, 0).choices) == {"swap"}
    assert karma.plan(layers, fast_copy, compute, total).choices == ["keep"] * BLOCKS
    assert karma.recompute_threshold(Link(0.0, 25e9), karma.Compute(0.0, 1e15)) == 80_000
    assert "choice" in str(plan)
    with pytest.raises(ValueError, match="activation_budget"):
        karma.plan(layers, slow_copy, compute, -1)
    # a plan fitted on this machine trains exactly as in memory
    x = _data()[0]
    fitted = karma.plan(layers, karma.fit_copy(repeats=1), karma.fit_compute(_model(), x, 1),
                        total // 3)
    assert torch.equal(_offloaded(fitted.choices, "host")[0], _in_memory())


def _zero(optimizer_factory, stage):
    from minipar.data_parallel import shard, shard_weight

    model, (x, y) = _model(), _data()
    zero = ZeroDataParallel(model, optimizer_factory, stage=stage, bucket_bytes=16 << 10)
    tracker = MemoryTracker(model, zero.optimizer, zero.shards)
    for _ in range(STEPS):
        lx, ly = shard(x), shard(y)
        (mse(zero(lx), ly) * shard_weight(len(lx), len(x))).backward()
        zero.step()
    return _vector(model), tracker.sample("after step").optimizer


def test_zero_offload_on_two_ranks_equals_zero_and_one_process(cluster2):
    for stage in (1, 2):
        offloaded = cluster2.run(_zero, host_optimizer(_adam), stage)
        in_memory = cluster2.run(_zero, _adam, stage)
        for (got, state), (want, device_state) in zip(offloaded, in_memory, strict=True):
            assert torch.equal(got, want)
            assert state == 0 < device_state  # Adam's moments live on the host
        assert torch.allclose(offloaded[0][0], _in_memory(), rtol=1e-9, atol=1e-12)
