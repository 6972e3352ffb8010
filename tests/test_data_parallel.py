"""All-reduce data parallelism equals one process: loss and every gradient, every step."""

import pytest
import torch
import torch.distributed as dist
from conftest import value_errors

import minipar
from minipar import collectives
from minipar.data_parallel import DataParallel, shard, shard_weight
from minipar.models import TiedAutoencoder, mlp, regression_data

STEPS, BATCH = 3, 10  # 10 samples: uneven shards on 3 and 4 ranks


def _model(kind):
    if kind == "tied":
        return TiedAutoencoder(width=8, hidden=4, seed=0, dtype=torch.float64)
    return mlp([8, 16, 8], seed=0, dtype=torch.float64)


def _batches():
    x, _ = regression_data(STEPS * BATCH * 2, 8, seed=1, dtype=torch.float64)
    return x.split(BATCH)


def _loss(model, x):
    return ((model(x) - x) ** 2).mean()


def single_process(kind, accumulate=1):
    """The reference: one process, whole batches, SGD."""
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches, history = _batches(), []
    for step in range(STEPS):
        losses = []
        for micro in range(accumulate):
            loss = _loss(model, batches[step * accumulate + micro])
            loss.backward()
            losses.append(loss.item())
        history.append((losses, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
        opt.step()
        opt.zero_grad()
    return history


def data_parallel(kind, bucket_bytes, overlap, accumulate=1, set_to_none=True):
    model = _model(kind)
    with torch.no_grad():  # replicas start different: DataParallel must make them equal
        for p in model.parameters():
            p.add_(minipar.rank())
    ddp = DataParallel(model, bucket_bytes=bucket_bytes, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches, history = _batches(), []
    for step in range(STEPS):
        losses = []
        for micro in range(accumulate):
            batch = batches[step * accumulate + micro]
            local = shard(batch)
            loss = _loss(ddp, local) * shard_weight(len(local), len(batch))
            if micro < accumulate - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            losses.append(reported.item() / minipar.world_size())
        history.append((losses, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)  # False: .grad stays a view, zeroed in place
    return history


CONFIGS = [("mlp", None, False), ("mlp", 64, True), ("mlp", 1 << 20, False),
           ("tied", None, True), ("tied", 100, True)]


def _all_configs():
    runs = {config: data_parallel(*config) for config in CONFIGS}
    runs["accumulate"] = data_parallel("mlp", 64, True, accumulate=2)
    runs["views kept"] = data_parallel("mlp", 64, True, accumulate=2, set_to_none=False)
    return runs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.slow  # fresh ranks per world size, up to 4
def test_equals_single_process_every_step(world_size):
    results = minipar.launch(_all_configs, world_size, backend="gloo", timeout=90)
    for name in results[0]:
        reference = single_process(name[0] if isinstance(name, tuple) else "mlp",
                                   accumulate=1 if isinstance(name, tuple) else 2)
        for r in range(world_size):
            for step, ((losses, grads), (ref_losses, ref_grads)) in enumerate(
                    zip(results[r][name], reference, strict=True)):
                assert losses == pytest.approx(ref_losses, rel=1e-12, abs=1e-14), (name, r, step)
                for g, ref in zip(grads, ref_grads, strict=True):
                    assert torch.allclose(g, ref, rtol=1e-10, atol=1e-13), (name, r, step)


def _views(overlap):
    model = _model("mlp")
    ddp = DataParallel(model, bucket_bytes=64, overlap=overlap)
    found = []
    for _ in range(2):
        _loss(ddp, shard(_batches()[0])).backward()
        found.append([any(p.grad.data_ptr() == v.data_ptr() for b in ddp.buckets
                          for v in b.views.values()) for p in model.parameters()])
    return found


def test_gradients_are_views_into_the_buckets(cluster2):
    """No copy out after the all-reduce: each .grad is its bucket's slice (DDP's
    gradient_as_bucket_view), and stays one while backward accumulates into it."""
    for overlap in (False, True):
        for found in cluster2.run(_views, overlap):
            assert all(all(step) for step in found), (overlap, found)


def test_overlap_shows_in_the_timeline(cluster2):
    def step():
        model = mlp([64, 256, 256, 256, 64], seed=0)
        ddp = DataParallel(model, bucket_bytes=64 << 10, overlap=True)
        x = torch.randn(64, 64)
        for _ in range(2):
            with minipar.record("compute", "backward"):
                ((ddp(x) - x) ** 2).mean().backward()
        return len(ddp.buckets)

    results = cluster2.run(step)
    timeline = results.timeline
    backward = [e for e in timeline if e.label == "backward" and e.rank == 0]
    buckets = [e for e in timeline if e.kind == "all_reduce" and e.rank == 0]
    assert results[0] > 1 and len(buckets) == 2 * results[0]
    # at least one bucket's all-reduce starts before its backward has finished
    assert any(b.start < bw.end and b.end > bw.start for b in buckets for bw in backward)


def test_bad_input_is_explained(cluster2):
    def bad():
        return value_errors(lambda: DataParallel(mlp([2, 2]), bucket_bytes=0),
                            lambda: DataParallel(mlp([2, 2]), algorithm="star"),
                            lambda: shard(torch.zeros(1, 2)))

    errors = cluster2.run(bad)[0]
    assert "bucket_bytes must be a positive int" in errors[0]
    assert "algorithm must be one of" in errors[1]
    assert "a batch of 1 samples cannot feed 2 ranks" in errors[2]


def test_per_parameter_mode_sends_one_all_reduce_per_parameter(cluster2):
    def count():
        model = mlp([4, 4, 4], seed=0)
        ddp = DataParallel(model, bucket_bytes=None)
        with collectives.meter() as m:
            ((ddp(torch.ones(2, 4))) ** 2).mean().backward()
        return len(ddp.buckets), m.steps

    buckets, steps = cluster2.run(count)[0]
    assert buckets == 4 and steps == 4 * 2  # 4 parameters, ring on 2 ranks: 2 steps each


@pytest.mark.slow  # lessons 00 and 02 run it under nbval too
def test_speedup_in_turns_times_both_sides_every_round():
    from minipar.data_parallel.speedup import speedup_in_turns

    rows = speedup_in_turns((4, 16), width=32, rounds=2, steps=1)
    assert [r["per_rank"] for r in rows] == [4, 16]
    for r in rows:
        assert len(r["speedups"]) == 2 and r["low"] <= r["median"] <= r["high"]
        assert r["one_rank_step"] > 0 and r["step"] > 0
        assert r["exposed"] == pytest.approx(r["step"] - r["one_rank_step"])


def test_speedup_in_turns_rejects_a_race_with_one_rank():
    from minipar.data_parallel.speedup import speedup_in_turns

    with pytest.raises(ValueError, match="ranks >= 2"):
        speedup_in_turns((4,), ranks=1)
