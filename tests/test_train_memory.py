"""The trainer's memory per rank by kind (train/memory_report.py): what one untimed step measures
(lesson 06's MemoryTracker; a pipeline's saved-activation meter) beside the planner's
formulas, on one process, dp = 2 with and without ZeRO-1, pp = 2 and pp x tp; and the
measured step leaves the run as it was.

Parameters, gradients and optimizer state are counted alike by both sides (bytes of the
tensors the rank holds, by the config's exact parameter count), so they are held to
each other within ZeRO's padding. Activations are shown beside the formula but not held
to it: Korthikanti's formula counts Megatron's tensors (dropout masks, 16-bit softmax
inputs, a fixed count per layer), not what autograd saves for this decoder."""

import json
from dataclasses import replace

import pytest
import torch
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

import minipar
from minipar.sharded.memory_tracker import KINDS
from minipar.train.data import BatchSampler, load_tokens
from minipar.train.loop import build_part, train, train_step
from minipar.train.memory_report import memory_by_kind, memory_table, predicted_memory
from minipar.train.precision import LossScaler

FP64 = 8  # bytes per value: the tiny configs train in float64


def short(corpus: str, **parallel):  # noqa: F811
    """tiny's config for 3 steps (Adam's state exists at the end), no evaluation between."""
    config = tiny(corpus, **parallel)
    return replace(config, optim=replace(config.optim, warmup_steps=1),
                   train=replace(config.train, steps=3, eval_every=0))


def _memory(config) -> dict:
    return train(config).memory


def test_one_process_measures_exactly_what_it_holds(corpus, tmp_path):  # noqa: F811
    """One process holds the whole model: parameters and gradients are its exact byte
    count, Adam's two states twice that; the prediction says the same; memory.json has
    the row."""
    config = short(corpus)
    row = minipar.launch(train, 1, config, str(tmp_path))[0].memory
    exact = config.model.parameters() * FP64
    measured, predicted = row["measured"], row["predicted"]
    assert measured["parameters"] == measured["gradients"] == exact
    assert measured["optimizer"] == 2 * exact
    assert measured["activations"] > 0
    assert {k: predicted[k] for k in KINDS[:3]} == {k: measured[k] for k in KINDS[:3]}
    saved = json.loads((tmp_path / "memory.json").read_text())
    assert [r["rank"] for r in saved] == [0] and saved[0]["measured"] == measured
    assert row["allocator_peak"] is None  # torch counts no allocator peak on a CPU
    assert "allocator peak" not in memory_table(saved)


def test_on_a_gpu_the_table_shows_the_allocators_peak_beside_tracker_and_planner():
    kinds = dict.fromkeys(KINDS, 2**20)
    rows = [{"rank": r, "coords": {"dp": r}, "measured": kinds, "predicted": kinds,
             "allocator_peak": (5 + r) * 2**20} for r in range(2)]
    table = memory_table(rows)
    assert "allocator peak: the most torch held on the GPU over the run" in table
    assert table.splitlines()[-1].split()[-1] == "6.000"  # rank 1's 6 MiB, last column


def test_zero_1_halves_the_optimizer_state_on_2_ranks(cluster2, corpus):  # noqa: F811
    """dp = 2: ZeRO-1 holds about half of DDP's optimizer bytes (its padded slice), the same
    parameters and gradients; the prediction within the padding (< 0.1%)."""
    ddp = cluster2.run(_memory, short(corpus, dp=2))
    zero = cluster2.run(_memory, short(corpus, dp=2, zero=1))
    for plain, sharded in zip(ddp, zero, strict=True):
        ratio = sharded["measured"]["optimizer"] / plain["measured"]["optimizer"]
        assert 0.5 <= ratio < 0.501, ratio  # padding adds at most dp - 1 values per shard
        assert sharded["measured"]["gradients"] == plain["measured"]["gradients"]
        for row in (plain, sharded):
            for kind in ("parameters", "gradients", "optimizer"):
                measured, predicted = row["measured"][kind], row["predicted"][kind]
                assert abs(measured / predicted - 1) < 1e-3, (kind, measured, predicted)


def test_zero_2_and_3_shard_gradients_and_weights(cluster2, corpus):  # noqa: F811
    """dp = 2: ZeRO-2 and 3 keep fewer gradient bytes at their peak than DDP (reduce-scattered
    as buckets or units complete). ZeRO-3's parameters at their peak are this rank's
    slices plus the units gathered at that moment: on this 2-block model with a large
    tied embedding in the root unit, gathered for the whole step, that is more than half
    the model, and here more than all of it (the gathering's price on a shallow model)."""
    ddp, two, three = (cluster2.run(_memory, short(corpus, dp=2, zero=z))[0]["measured"]
                       for z in (0, 2, 3))
    assert two["gradients"] < ddp["gradients"] and three["gradients"] < ddp["gradients"]
    assert ddp["parameters"] / 2 < three["parameters"] < ddp["parameters"] * 3 / 2, three
    assert two["optimizer"] == three["optimizer"] < ddp["optimizer"]


def test_pipeline_ranks_hold_their_stages(cluster2, corpus):  # noqa: F811
    """pp = 2: each rank holds less than one process, and together exactly the model plus
    the tied embedding's second copy (the last stage's head), which the planner's even
    split leaves out: each rank measures more than it predicts."""
    config = short(corpus, pp=2, microbatches=2)
    rows = cluster2.run(_memory, config)
    whole = config.model.parameters() * FP64
    tied_copy = config.model.vocab_size * config.model.hidden * FP64
    held = [r["measured"]["parameters"] for r in rows]
    assert all(h < whole for h in held), held
    assert sum(held) == whole + tied_copy
    assert all(r["measured"]["parameters"] > r["predicted"]["parameters"] for r in rows)
    # the meter saw each stage's activations, two micro-batches in flight on the first
    assert all(r["measured"]["activations"] > 0 for r in rows)


def test_pp_tp_on_4_ranks(cluster4, corpus):  # noqa: F811
    """pp = 2 x tp = 2: the blocks' matrices split over tp but the embedding and norms whole,
    so a rank holds more than its 1/4 of the model (the planner's even split), less than
    the half a whole stage is, as much as its tp partner."""
    config = short(corpus, pp=2, tp=2, microbatches=2)
    rows = cluster4.run(_memory, config)
    whole = config.model.parameters() * FP64
    for r in rows:
        held = r["measured"]["parameters"]
        assert whole / 4 == r["predicted"]["parameters"] < held < whole / 2, r
        assert r["measured"]["gradients"] == held
        assert r["measured"]["optimizer"] == 2 * held
    for pp in (0, 1):
        pair = {r["measured"]["parameters"] for r in rows if r["coords"]["pp"] == pp}
        assert len(pair) == 1, pair


def _next_step(config, measure: bool) -> list[torch.Tensor]:
    """This rank's parameters after one training step, with or without a measured step
    (on a held-out batch) before it."""
    part = build_part(config)
    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    batch, seq_len = config.train.batch_size, config.model.seq_len
    sampler = BatchSampler(tokens.train, seq_len, batch, 0, part.dp_rank, part.dp)
    held_out = BatchSampler(tokens.val, seq_len, batch, 1, part.dp_rank, part.dp)
    if measure:
        memory_by_kind(part, *held_out.next(), batch)
    for _ in range(2):  # the second step: Adam's moments from the first
        train_step(part, LossScaler(False), *sampler.next(), config, lr=1e-2)
    return [p.detach().clone() for p in part.parameters()]


@pytest.mark.parametrize("parallel", [dict(dp=2, zero=2), dict(pp=2, zero=0, microbatches=2)],
                         ids=["dp=2 zero=2", "pp=2"])
def test_the_measured_step_leaves_no_trace(cluster2, corpus, parallel):  # noqa: F811
    """A measured step before training changes nothing that follows: the weights after two
    steps are bitwise those of a model part never measured (no update, no gradient left
    behind, not even ZeRO-2's reduced slices)."""
    config = short(corpus, **parallel)
    measured = cluster2.run(_next_step, config, True)
    plain = cluster2.run(_next_step, config, False)
    for mine, theirs in zip(measured, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_prediction_follows_the_layout(corpus):  # noqa: F811
    """The formulas' own arithmetic: ZeRO-1 divides the optimizer by dp, pp x tp the
    parameters, tp part of the activations and sequence parallelism all of them, full
    recomputation keeps less."""
    one, zero = predicted_memory(short(corpus)), predicted_memory(short(corpus, dp=2, zero=1))
    assert zero["optimizer"] == one["optimizer"] / 2
    assert zero["parameters"] == one["parameters"]
    split = predicted_memory(short(corpus, pp=2, tp=2, microbatches=2))
    assert split["parameters"] == one["parameters"] / 4
    tp = predicted_memory(short(corpus, tp=2))
    sp = predicted_memory(short(corpus, tp=2, sequence_parallel=True))
    # Korthikanti's Eq. 2: without sequence parallelism tp splits only part of each layer
    assert sp["activations"] == pytest.approx(one["activations"] / 2)
    assert sp["activations"] < tp["activations"] < one["activations"]
    base = short(corpus)
    full = predicted_memory(replace(base, train=replace(base.train, recompute="full")))
    assert full["activations"] < one["activations"]
