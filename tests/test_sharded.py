"""ZeRO-1/2 and FSDP (ZeRO-3) train exactly like one process, send what the paper says,
and keep only their shard."""

import pytest
import torch
from conftest import value_errors
from torch import nn

import minipar
from minipar import collectives
from minipar.data_parallel import shard, shard_weight
from minipar.models import regression_data
from minipar.sharded.fsdp import FullyShardedDataParallel
from minipar.sharded.zero import FlatShard, ZeroDataParallel

STEPS, BATCH, LR = 3, 12, 0.05


def tricky_model():
    """65 trainable numbers (divisible by neither 2, 3 nor 4), a weight tied between two
    layers and a frozen bias."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(),
                          nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model[4].weight = model[2].weight
    model[6].bias.requires_grad_(False)
    return model


def plain_model():
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(2, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 3)).double()


def _batches(inputs=2, outputs=3):
    x, y = regression_data(STEPS * BATCH, inputs, seed=7, dtype=torch.float64)
    y = y.expand(-1, outputs) * torch.arange(1.0, outputs + 1, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def adam(params):
    return torch.optim.Adam(params, lr=LR)


def one_process(make):
    model = make()
    opt = adam([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x, y in _batches():
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def sharded_training(stage, make):
    model = make()
    wrapped = FullyShardedDataParallel(model, adam, prefetch=stage == "3+prefetch") \
        if str(stage).startswith("3") else \
        ZeroDataParallel(model, adam, stage=stage, bucket_bytes=256)
    losses = []
    for x, y in _batches():
        lx, ly = shard(x), shard(y)
        loss = ((wrapped(lx) - ly) ** 2).mean()
        (loss * shard_weight(lx.shape[0], x.shape[0])).backward()
        wrapped.step()
        total = collectives.all_reduce(loss.detach() * lx.shape[0]) / x.shape[0]
        losses.append(total.item())
    if str(stage).startswith("3"):
        wrapped.gather_parameters()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3, "3+prefetch"])
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow), 4])
@pytest.mark.slow  # every ZeRO stage on fresh ranks per world size
def test_every_stage_trains_like_one_process(stage, world_size, request):
    want_losses, want_params = one_process(tricky_model)
    shared = {2: "cluster2", 4: "cluster4"}
    if world_size in shared:
        runs = request.getfixturevalue(shared[world_size]).run(sharded_training, stage,
                                                               tricky_model)
    else:
        runs = minipar.launch(sharded_training, world_size, stage, tricky_model)
    for rank, (losses, params) in enumerate(runs):
        assert losses == pytest.approx(want_losses, rel=1e-12), rank
        for got, want in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _step_bytes(stage):
    model = plain_model()
    wrapped = FullyShardedDataParallel(model, adam) if stage == 3 else \
        ZeroDataParallel(model, adam, stage=stage, bucket_bytes=1 << 20)
    x = torch.randn(8, 2, dtype=torch.float64)
    with collectives.meter() as m:
        wrapped(shard(x)).pow(2).mean().backward()
        wrapped.step()
    shards = wrapped.units if stage == 3 else wrapped.shards
    slices = sum((u.shard if stage == 3 else u).slice for u in shards)
    return m.sent_bytes, slices


def test_communication_is_data_parallels_and_one_and_a_half_times_that(cluster4):
    k = 4
    one, two, three = (cluster4.run(_step_bytes, stage)[0] for stage in (1, 2, 3))
    (sent1, slices), (sent2, _), (sent3, _) = one, two, three
    assert sent1 == sent2 == 2 * (k - 1) * slices * 8  # reduce-scatter + all-gather
    assert sent3 == 3 * (k - 1) * slices * 8  # + the all-gather before backward
    assert sent3 / sent1 == 1.5


def _what_stays(stage):
    model = plain_model()
    wrapped = FullyShardedDataParallel(model, adam) if stage == 3 else \
        ZeroDataParallel(model, adam, stage=stage)
    x = torch.randn(8, 2, dtype=torch.float64)
    wrapped(shard(x)).pow(2).mean().backward()
    grads_after_backward = sum(p.grad.numel() for p in model.parameters()
                               if p.grad is not None)
    wrapped.step()
    state = sum(t.numel() for s in wrapped.optimizer.state.values() for t in s.values()
                if t.dim() > 0)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    return grads_after_backward, state, sum(storages.values()) // 8


def test_each_stage_keeps_only_its_shard(cluster4):
    total = sum(p.numel() for p in plain_model().parameters())
    padded = -(-total // 4)
    for stage in (1, 2, 3):
        grads, state, params = cluster4.run(_what_stays, stage)[0]
        assert state == 2 * padded  # Adam's two moments, for this rank's slice only
        assert grads == (total if stage == 1 else 0)  # stage 2 frees gradients in backward
        assert params == (0 if stage == 3 else 4 * padded)  # one flat buffer; stage 3 frees it


def test_flat_shard_pads_and_cuts_back(cluster2):
    def run():
        params = [nn.Parameter(torch.arange(3.0)), nn.Parameter(torch.ones(2, 2))]
        flat = FlatShard(params)
        full = flat.gather()
        return flat.slice, flat.master.tolist(), [t.tolist() for t in flat.pieces(full)]

    (slice0, mine0, pieces), (_, mine1, _) = cluster2.run(run)
    assert slice0 == 4 and mine0 == [0.0, 1.0, 2.0, 1.0] and mine1 == [1.0, 1.0, 1.0, 0.0]
    assert pieces == [[0.0, 1.0, 2.0], [[1.0, 1.0], [1.0, 1.0]]]


def test_bad_arguments_say_what_to_change():
    model = plain_model()
    assert value_errors(lambda: ZeroDataParallel(model, adam, stage=3),
                        lambda: ZeroDataParallel(model, adam, bucket_bytes=0),
                        lambda: FullyShardedDataParallel(nn.Sequential(nn.Tanh()), adam)) == [
        "stage must be 1 or 2 (stage 3 is FullyShardedDataParallel); got 3",
        "bucket_bytes must be a positive int; got 0",
        "module has no parameter with requires_grad=True to train"]


def torch_training(kind):
    """The same steps with torch's own: DDP + ZeroRedundancyOptimizer, or FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = plain_model()
    if kind == "zero1":
        run = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=LR)
    else:
        mesh = init_device_mesh("cpu", (minipar.world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        run = fully_shard(model, mesh=mesh)
        opt = adam(model.parameters())
    for x, y in _batches():
        loss = ((run(shard(x)) - shard(y)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [(p.full_tensor() if kind == "fsdp2" else p).detach().clone()
            for p in model.parameters()]


@pytest.mark.parametrize("stage, kind", [(1, "zero1"), (3, "fsdp2")])
def test_matches_torchs_own(stage, kind, cluster2):
    ours = cluster2.run(sharded_training, stage, plain_model)
    theirs = cluster2.run(torch_training, kind)
    for (_, mine), reference in zip(ours, theirs, strict=True):
        for a, b in zip(mine, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _measured_after_backward(stage):
    from minipar.data_parallel import DataParallel
    from minipar.sharded.memory_tracker import MemoryTracker

    model = plain_model()
    if stage == 0:
        wrapped = DataParallel(model)
        opt = adam(model.parameters())
        shards = []
    else:
        wrapped = FullyShardedDataParallel(model, adam) if stage == 3 else \
            ZeroDataParallel(model, adam, stage=stage)
        opt, shards = wrapped.optimizer, wrapped.shards
    tracker = MemoryTracker(model, opt, shards)
    x = torch.randn(8, 2, dtype=torch.float64)
    for _ in range(2):  # the second step finds the optimizer state in place
        with tracker.watch():
            wrapped(shard(x)).pow(2).mean().backward()
        after_backward = tracker.sample("after backward")
        opt.step() if stage == 0 else wrapped.step()
        opt.zero_grad(set_to_none=True)
    forward = [s for s in tracker.samples if s.label.startswith("forward")]
    return after_backward, max(s.activations for s in forward)


def test_memory_measured_is_zero_formula(cluster4):
    from minipar import cost

    params = sum(p.numel() for p in plain_model().parameters())
    full = cost.training_memory(params, weights="fp64", grads="fp64", optimizer="adam",
                                optimizer_dtype="fp64")
    for stage in (0, 1, 2, 3):
        got, activations = cluster4.run(_measured_after_backward, stage)[1]
        want = cost.zero_memory(full, stage, 4)
        for kind, formula in (("parameters", want.weights), ("gradients", want.gradients),
                              ("optimizer", want.optimizer)):
            assert getattr(got, kind) == pytest.approx(formula, rel=0.1), (stage, kind)
        assert got.activations == 0 and activations > 0  # saved in forward, freed by backward


def _mixed(stage):
    """Mixed precision: bf16 model and gradients, float32 master slices and Adam."""
    model = plain_model_float32()
    wrapped = FullyShardedDataParallel(model, adam, param_dtype=torch.bfloat16) if stage == 3 \
        else ZeroDataParallel(model, adam, stage=stage, param_dtype=torch.bfloat16)
    from minipar.sharded.memory_tracker import MemoryTracker

    tracker = MemoryTracker(model, wrapped.optimizer, wrapped.shards)
    losses, held = [], None
    for x, y in _batches(inputs=2, outputs=3):
        loss = ((wrapped(shard(x)).float() - shard(y)) ** 2).mean()
        loss.backward()
        held = tracker.sample("after backward")
        wrapped.step()
        losses.append(collectives.all_reduce(loss.detach(), op="avg").item())
    if stage == 3:
        wrapped.gather_parameters()
    return losses, [p.detach().float().clone() for p in model.parameters()], held


def plain_model_float32():
    return plain_model().float()


def test_mixed_precision_keeps_16_bytes_per_parameter_sharded(cluster2):
    from minipar import cost

    params = sum(p.numel() for p in plain_model().parameters())
    mixed = cost.training_memory(params, weights="bf16", grads="bf16", optimizer="adam",
                                 optimizer_dtype="fp32", master_weights="fp32")
    assert mixed.bytes_per_param == 16
    runs = {stage: cluster2.run(_mixed, stage) for stage in (1, 2, 3)}
    for stage, per_rank in runs.items():
        want = cost.zero_memory(mixed, stage, 2)
        got = per_rank[0][2]
        assert got.gradients == pytest.approx(want.gradients, rel=0.1), stage
        assert got.optimizer == pytest.approx(want.optimizer, rel=0.1), stage
        # stage 3 keeps no 16-bit shard at rest: it casts the master when it gathers
        assert got.parameters == (0 if stage == 3 else pytest.approx(want.weights, rel=0.1))
    # the three stages do the same arithmetic: the same numbers, bit for bit
    for stage in (2, 3):
        for a, b in zip(runs[1][0][1], runs[stage][0][1], strict=True):
            assert torch.equal(a, b), stage
    reference_losses, _ = one_process(plain_model)
    assert runs[1][0][0] == pytest.approx(reference_losses, rel=2e-2)  # bf16 is close, not equal


def _with_recomputation(stage, on):
    from minipar.sharded.fsdp import default_units
    from minipar.sharded.memory_tracker import MemoryTracker, recompute

    torch.manual_seed(8)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16),
                                          nn.Tanh()) for _ in range(4)]).double()
    if on:
        recompute(default_units(model))
    wrapped = FullyShardedDataParallel(model, adam) if stage == 3 else \
        ZeroDataParallel(model, adam, stage=stage)
    tracker = MemoryTracker(model, wrapped.optimizer, wrapped.shards)
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with tracker.watch():
        wrapped(shard(x)).pow(2).mean().backward()
    wrapped.step()
    if stage == 3:
        wrapped.gather_parameters()
    peak = max(s.activations for s in tracker.samples)
    return peak, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 3])
def test_recomputation_keeps_one_input_per_unit_and_changes_nothing_else(stage, cluster2):
    (plain, params), _ = cluster2.run(_with_recomputation, stage, False)
    (recomputed, params_r), _ = cluster2.run(_with_recomputation, stage, True)
    for a, b in zip(params, params_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # without: each block saves its input, two tanh outputs and the hidden layer's input;
    # with: only each block's 16-wide input survives until backward
    assert 0 < recomputed < plain / 2, (recomputed, plain)


def test_tracker_sees_what_recomputation_rebuilds_in_backward():
    from minipar.sharded.memory_tracker import MemoryTracker, recompute

    def peaks(on):
        torch.manual_seed(8)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16),
                                              nn.Tanh()) for _ in range(4)]).double()
        if on:
            recompute(list(model))
        tracker = MemoryTracker(model)
        with tracker.watch():
            model(torch.randn(128, 16, dtype=torch.float64)).pow(2).mean().backward()
        forward = max(s.activations for s in tracker.samples if s.label.startswith("forward"))
        backward = max(s.activations for s in tracker.samples if s.label == "backward")
        return forward, backward

    block_input, hidden = 128 * 16 * 8, 128 * 64 * 8  # bytes of a block's input, its tanh
    plain, _ = peaks(False)
    assert plain == 4 * (block_input + hidden) + block_input  # 4 blocks' saved tensors
    forward, backward = peaks(True)
    assert forward == 4 * block_input  # only the inputs survive forward
    # in backward one block at a time is rebuilt (its 64-wide tanh and its output) beside
    # the inputs not yet consumed: more than forward's inputs, far less than no recompute
    assert forward + hidden <= backward < plain / 2, (forward, backward, plain)


def _prefetch_timeline():
    model = plain_model()
    fsdp = FullyShardedDataParallel(model, adam, prefetch=True)
    x = torch.randn(8, 2, dtype=torch.float64)
    with minipar.record("compute", "step"):
        fsdp(shard(x)).pow(2).mean().backward()
        fsdp.step()


def test_prefetch_runs_every_collective_on_one_background_thread(cluster2):
    timeline = cluster2.run(_prefetch_timeline).timeline
    gathers = [e for e in timeline if e.kind in ("all_gather", "reduce_scatter")]
    assert len([e for e in gathers if e.kind == "all_gather"]) == 2 * 3 * 2  # 3 units, twice
    assert {e.thread for e in gathers} != {0}  # not the main thread
    assert len({(e.rank, e.thread) for e in gathers}) == 2  # one thread per rank
