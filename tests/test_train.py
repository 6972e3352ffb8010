"""The trainer: its loop on one process and its compositions over ranks give the same loss
curve (float64, every step), clipping by the global norm equals torch's, the learning
rate follows its schedule, and a run leaves its metrics."""

import json
import math
from dataclasses import replace

import pytest
import torch

import minipar
from minipar.decoder import DecoderConfig, decoder
from minipar.train.config import (
    DataConfig,
    LoopConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from minipar.train.loop import refuse_unbuilt, train
from minipar.train.metrics import read_metrics
from minipar.train.optim import clip_, global_norm, learning_rate

WORDS = ("def return import class self lambda yield while for in if else elif try except "
         "with as pass break continue raise assert global nonlocal from print len range")


def write_corpus(folder, documents: int = 6, words_per_document: int = 600,
                 words: str = WORDS) -> str:
    """`documents` files of seeded random Python-ish words in `folder`; its path."""
    gen = torch.Generator().manual_seed(0)
    vocabulary = words.split()
    for d in range(documents):
        picks = torch.randint(0, len(vocabulary), (words_per_document,), generator=gen).tolist()
        (folder / f"doc{d}.py").write_text(" ".join(vocabulary[i] for i in picks))
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small text folder (a few "documents" of Python-ish words), seeded."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def tiny(corpus: str, **parallel) -> TrainConfig:
    """20 float64 steps of a 2-layer decoder, accumulating 2 chunks, clipping active."""
    return TrainConfig(
        model=DecoderConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16),
        data=DataConfig(path=corpus, val_fraction=0.2, seed=1),
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5, grad_clip=0.5),
        train=LoopConfig(batch_size=8, accumulation=2, steps=20, eval_every=10, eval_batches=2,
                         log_every=10, precision="fp64", seed=2))


@pytest.fixture(scope="module")
def one_process(corpus):
    return minipar.launch(train, 1, tiny(corpus), None, True)[0]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_runs_equal_one_process(cluster2, corpus, one_process, zero):
    """dp=2 with DDP buckets or ZeRO-1/2/3: every step's loss, gradient norm and
    validation loss, and the final weights, equal one process's (float64)."""
    runs = cluster2.run(train, tiny(corpus, dp=2, zero=zero), None, True)
    ref = one_process
    for run in runs:
        assert len(run.records) == 20
        for mine, theirs in zip(run.records, ref.records, strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert math.isclose(mine[key], theirs[key], rel_tol=1e-10, abs_tol=1e-12), \
                    (zero, mine["step"], key)
            if "val_loss" in theirs:
                assert math.isclose(mine["val_loss"], theirs["val_loss"], rel_tol=1e-10)
        for name, weight in ref.weights.items():
            assert torch.allclose(run.weights[name], weight, rtol=1e-9, atol=1e-12), name
    assert ref.records[0]["grad_norm"] > 0.5  # the clip really acted
    assert ref.losses[-1] < ref.losses[0]  # and the model learned


@pytest.mark.parametrize("zero, recompute", [(0, "selective"), (0, "full"), (1, "full"),
                                             (3, "full")])
@pytest.mark.slow  # trainer runs per ZeRO stage and policy
def test_recomputation_changes_nothing_but_memory(cluster2, corpus, one_process, zero,
                                                  recompute):
    """Recomputed activations are the same numbers: the curve equals one process's without
    recomputation (float64), under DDP and ZeRO alike."""
    base = tiny(corpus, dp=2, zero=zero)
    runs = cluster2.run(train, replace(base, train=replace(base.train, recompute=recompute)))
    for a, b in zip(runs[0].records, one_process.records, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-10), (zero, recompute, a["step"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-10)


def test_recomputation_keeps_less_for_backward():
    """What autograd keeps after forward (measured by the pipeline's meter): full < selective
    < none, and each gives the same gradients."""
    from minipar.pipeline.stage import SavedActivationMeter
    from minipar.train.recompute import apply_recompute

    config = DecoderConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=64)
    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    kept, grads = {}, {}
    for policy in ("none", "selective", "full"):
        model = decoder(config, seed=1, dtype=torch.float64)
        apply_recompute(model, policy)
        meter = SavedActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
        with meter.recording():
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        kept[policy] = meter.now
        loss.backward()
        grads[policy] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert torch.allclose(grads["full"], grads["none"], rtol=1e-12, atol=1e-15)
    assert torch.allclose(grads["selective"], grads["none"], rtol=1e-12, atol=1e-15)


def test_clipping_by_the_global_norm_equals_torchs():
    model = decoder(DecoderConfig(layers=1, hidden=16, heads=2, kv_heads=1, seq_len=8),
                    seed=0, dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = global_norm([p.grad for p in model.parameters()])
    clip_([p.grad for p in model.parameters()], norm, norm / 2)
    mine = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    theirs_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), norm / 2)
    assert math.isclose(norm, theirs_norm.item(), rel_tol=1e-12)
    # torch takes the norm of per-tensor norms: the same value up to rounding, not bitwise
    assert all(torch.allclose(a, p.grad, rtol=1e-12, atol=0)
               for a, p in zip(mine, model.parameters(), strict=True))
    assert not all(torch.allclose(a, g) for a, g in zip(mine, grads, strict=True))  # clipped


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    rates = [learning_rate(s, optim, 20) for s in range(20)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(rates[3:], rates[4:], strict=False))
    assert math.isclose(rates[-1], 0.1)


@pytest.mark.parametrize("change, words", [
    (dict(schedule="pipedream", pp=2), "every micro-batch"),
    (dict(schedule="terapipe", pp=2), "token slices"),
    (dict(zero=3, dp=2, ep=2, experts=4), "zero 0, 1 or 2 with experts"),
    (dict(tp=2, experts=4), "use tp = cp = 1"),
    (dict(cp=2, experts=4), "use tp = cp = 1"),
    # a V's rank 0 holds both tied ends: said before ZeRO-3 would flatten the weight twice
    (dict(pp=2, schedule="zb_v", virtual=2, microbatches=4, dp=2, zero=3), "untie them"),
    (dict(pp=2, schedule="dualpipev", virtual=2, microbatches=4, zero=1), "untie them"),
])
def test_what_the_trainer_does_not_compose_is_one_line(change, words):
    model = DecoderConfig(experts=change.pop("experts", 0))
    with pytest.raises(ValueError, match=words) as err:
        refuse_unbuilt(replace(TrainConfig(), model=model, parallel=ParallelConfig(**change)))
    assert "\n" not in str(err.value)


def test_a_run_leaves_its_config_and_one_metrics_line_per_step(corpus, tmp_path):
    config = replace(tiny(corpus), train=replace(tiny(corpus).train, steps=3, eval_every=0,
                                                 precision="fp32"),
                     optim=replace(tiny(corpus).optim, warmup_steps=1))
    minipar.launch(train, 1, config, tmp_path)
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert all(math.isfinite(r[key]) for r in lines), key
    assert "val_loss" in lines[-1] and "val_loss" not in lines[0]  # 0: only at the end
    assert all(0 < r["mfu"] <= 1 for r in lines)  # the peak is the model's own matmuls
    assert "[model]" in (tmp_path / "config.toml").read_text()
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    trace = json.loads((tmp_path / "step.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"forward+backward", "optimizer"} <= names


def test_a_run_on_two_ranks_traces_one_step_of_both(cluster2, corpus, tmp_path):
    config = tiny(corpus, dp=2)
    config = replace(config, train=replace(config.train, steps=4, eval_every=0),
                     optim=replace(config.optim, warmup_steps=1))
    cluster2.run(train, config, tmp_path)
    trace = json.loads((tmp_path / "step.trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}


def _overflow_on(rank_with_inf: int, scale: float) -> tuple[bool, float, list[float]]:
    """One fp16 scaler step on this rank, with an inf in rank `rank_with_inf`'s gradient."""
    from minipar.train.precision import LossScaler

    scaler = LossScaler(enabled=True, scale=scale)
    grads = [torch.full((3,), scale), torch.full((2,), 2 * scale)]
    if minipar.rank() == rank_with_inf:
        grads[1][0] = math.inf
    overflow = scaler.unscale_and_check(grads)
    scaler.update(overflow)
    return overflow, scaler.scale, grads[0].tolist()


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(cluster2):
    """The overflow is agreed: both ranks skip and halve the scale together (a rank
    skipping alone would leave the replicas with different weights)."""
    for r in (0, 1):
        results = cluster2.run(_overflow_on, r, 1024.0)
        assert [o for o, _, _ in results] == [True, True]
        assert [s for _, s, _ in results] == [512.0, 512.0]
    clean = cluster2.run(_overflow_on, 5, 1024.0)  # no rank 5: no inf anywhere
    assert [o for o, _, _ in clean] == [False, False]
    assert all(g == [1.0, 1.0, 1.0] for _, _, g in clean)  # unscaled


@pytest.mark.parametrize("precision, parallel", [
    ("bf16", dict(dp=2, zero=1)),
    ("fp16", dict(dp=2, zero=1)),
    ("fp16", dict(pp=2, microbatches=2)),  # inside the pipeline's stages (AutocastStage)
    ("bf16", dict(tp=2, sequence_parallel=True)),  # through tp's collectives
])
@pytest.mark.slow  # two trainer runs per precision and layout
def test_mixed_precision_tracks_float32(cluster2, corpus, precision, parallel):
    """bf16 and fp16 (float32 masters, 16-bit matmuls; fp16's loss scale folded into the
    loss) follow the float32 run's loss curve within a few percent over 8 steps on 2 ranks
    (a bound, not equality: 16-bit rounding), and fp16 reports its loss scale."""
    base = tiny(corpus, **parallel)  # 8 steps: fp16 matmuls are slow on most CPUs
    base = replace(base, train=replace(base.train, steps=8, eval_every=0),
                   optim=replace(base.optim, warmup_steps=2))
    fp32 = cluster2.run(train, replace(base, train=replace(base.train, precision="fp32")))[0]
    mixed = cluster2.run(train, replace(base, train=replace(base.train,
                                                            precision=precision)))[0]
    for a, b in zip(mixed.losses, fp32.losses, strict=True):
        assert abs(a - b) < 0.05 * b, (precision, a, b)
    if precision == "fp16":
        assert all(r["loss_scale"] >= 1 for r in mixed.records)


def _shares_a_group(config) -> list[str]:
    from minipar.train.loop import build_part

    part = build_part(config)
    g = part.groups
    return [d for d in ("dp", "cp", "ep", "tp", "pp") if getattr(g, d) is part.replicas]


@pytest.mark.parametrize("parallel", [dict(cp=2), dict(dp=2)], ids=["cp=2", "dp=2"])
def test_data_parallels_thread_has_a_group_of_its_own(cluster2, corpus, parallel):
    """DDP's buckets are all-reduced on a thread of their own; gloo mixes up two threads'
    messages on one group. With dp = 1 and cp = 2 the replicas were cp's ranks, and the
    group was cp's, whose ring attention sends in the same backward (the small preset
    crashed: "Received data size doesn't match expected size")."""
    assert cluster2.run(_shares_a_group, tiny(corpus, **parallel)) == [[], []]


def sampler_for(config, part):
    """The run's batches for this rank of `part` (the seed 0 sampler over the corpus)."""
    from minipar.train.data import BatchSampler, load_tokens

    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    return BatchSampler(tokens.train, config.model.seq_len, config.train.batch_size, 0,
                        part.dp_rank, part.dp)


def _handshakes_per_step(config) -> list[int]:
    """This rank's cross-rank handshakes (collectives.validation's all-gathers of
    metadata, on any thread) in each of three train_steps."""
    import torch.distributed as dist

    from minipar.train.loop import build_part, train_step
    from minipar.train.precision import LossScaler

    part, scaler = build_part(config), LossScaler(enabled=False)
    sampler = sampler_for(config, part)
    real, seen = dist.all_gather, [0]

    def counted(*args, **kwargs):  # minipar's collectives are sends and receives: only the
        seen[0] += 1               # handshake calls torch's all_gather
        return real(*args, **kwargs)

    counts = []
    dist.all_gather = counted
    try:
        for _ in range(3):
            before = seen[0]
            train_step(part, scaler, *sampler.next(), config, 1e-3)
            counts.append(seen[0] - before)
    finally:
        dist.all_gather = real
    return counts


def test_only_the_first_step_checks_its_collectives(cluster2, corpus):
    """The first step's collectives (ZeRO-3's gathers and reduce-scatters on the
    communication thread, the step's scalars on the main thread) each check their
    shapes across the ranks; the later steps make the same calls and skip the check."""
    for counts in cluster2.run(_handshakes_per_step, tiny(corpus, dp=2, zero=3)):
        assert counts[0] > 0 and counts[1:] == [0, 0], counts
