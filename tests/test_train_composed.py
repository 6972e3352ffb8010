"""The trainer composed over a mesh (dp x pp x cp x tp, sequence parallelism, DDP and
ZeRO-1/2/3 inside the pipeline, HSDP, recomputation, every synchronous schedule) trains
exactly as one process: every step's loss, global gradient norm and validation loss, and
every weight (each rank's slice of it), in float64, for 20 steps with accumulation and
clipping active. Where data parallelism reduces inside backward, a traced step shows it
there."""

import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_train import corpus, sampler_for, tiny  # noqa: F401  (corpus is a fixture)

import minipar
from minipar import trace
from minipar.collectives import host_staging
from minipar.mesh.stage_data_parallel import REDUCTIONS, hidden_and_exposed
from minipar.tensor_parallel import twin_slice
from minipar.trace import Event
from minipar.train.loop import build_part, train
from minipar.train.model_part import trainer_mesh
from minipar.train.optim import global_norm

# every rank of these tests computes on the faked device (issue 69, conftest.py)
# slow: every test starts a trainer job on 4 to 8 fresh ranks
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("faked_device_on")]

# (parallel degrees and techniques, train.recompute)
FOUR_RANKS = [
    (dict(dp=2, tp=2), "none"),
    (dict(cp=2, tp=2, sequence_parallel=True), "selective"),
    (dict(pp=2, dp=2, zero=1, microbatches=2), "none"),
    (dict(pp=2, tp=2, zero=2, schedule="gpipe", microbatches=2), "full"),
    (dict(pp=2, cp=2, schedule="zb_h1", microbatches=2), "none"),
    (dict(dp=2, cp=2, zero=1), "full"),
    # Ulysses: 4 query heads over cp 4, its 2 kv heads replicated to 4 (kv-head replication)
    (dict(cp=4, cp_kind="ulysses"), "selective"),
    # under tp 2 each rank has 2 heads and 1 kv head, replicated to cp 2
    (dict(cp=2, tp=2, cp_kind="ulysses", sequence_parallel=True), "none"),
]


def _deep(config):
    """Four untied layers (so pp=2 can hold two virtual stages each)."""
    return replace(config, model=replace(config.model, layers=4, tied=False))


@pytest.fixture(scope="module")
def one_process(corpus):  # noqa: F811
    return minipar.launch(train, 1, tiny(corpus), None, True)[0]


def _assert_same_run(runs, ref, config) -> None:
    for run in runs:
        assert len(run.records) == len(ref.records) == 20
        for mine, theirs in zip(run.records, ref.records, strict=True):
            for key in ("loss", "grad_norm", "lr", "val_loss"):
                if key in theirs:
                    assert math.isclose(mine[key], theirs[key], rel_tol=1e-10, abs_tol=1e-12), \
                        (config.parallel, mine["step"], key, mine[key], theirs[key])
    mesh, checked = trainer_mesh(config), set()
    for r, run in enumerate(runs):
        tp_rank = mesh.coords(r)["tp"]
        for name, weight in run.weights.items():
            full = ref.weights[name]
            assert torch.allclose(weight, twin_slice(full, weight, tp_rank, mesh["tp"]),
                                  rtol=1e-9, atol=1e-12), (config.parallel, r, name)
            checked.add(name)
    assert checked == set(ref.weights)  # every parameter lives on some rank
    assert ref.records[0]["grad_norm"] > 0.5  # the clip really acted


@pytest.mark.parametrize("parallel, recompute", FOUR_RANKS,
                         ids=[" ".join(f"{k}={v}" for k, v in p.items()) + f" {r}"
                              for p, r in FOUR_RANKS])
def test_a_composition_on_4_ranks_trains_as_one_process(cluster4, corpus, one_process,  # noqa: F811
                                                        parallel, recompute):
    config = tiny(corpus, **parallel)
    config = replace(config, train=replace(config.train, recompute=recompute))
    _assert_same_run(cluster4.run(train, config, None, True), one_process, config)


def _staged_train(config):
    before = host_staging.staged_messages
    with host_staging.forced():  # every message through host memory, as gloo on a GPU
        run = train(config, None, True)
    return run, host_staging.staged_messages - before


def test_a_composition_staged_through_host_memory_trains_as_one_process(cluster4, corpus,  # noqa: F811
                                                                        one_process):
    """Ranks sharing a GPU over gloo stage every message (collectives/host_staging.py):
    the pipeline's sends, the dp reduction inside backward, tp's collectives."""
    config = tiny(corpus, pp=2, dp=2, zero=1, microbatches=2)
    results = cluster4.run(_staged_train, config)
    assert all(staged > 100 for _, staged in results)  # 20 steps of sends and reductions
    _assert_same_run([run for run, _ in results], one_process, config)


def _reductions_in_backward(config) -> tuple[int, int]:
    """On this rank, in one traced optimizer-step chunk: the data-parallel reductions that
    were launched inside a pipeline backward (B or W), and all of them. A reduction on
    ZeRO-2's communication thread counts where backward queued it (it may start after)."""
    from minipar.train.precision import LossScaler

    part = build_part(config)
    with trace.capture() as captured:
        part.forward_backward(*sampler_for(config, part).next(), config.train.batch_size,
                                 LossScaler(False), last=True)
        part.reduce_gradients()
    events = captured.events
    backward = [(e.start, e.end) for e in events if e.kind in ("B", "W")]
    reductions = [e for e in events if e.label.startswith(REDUCTIONS)]
    queued = [e for e in events if e.kind == "queue"]
    launches = queued + [e for e in reductions if e.thread == 0 or not queued]
    inside = [e for e in launches if any(a <= e.start <= b for a, b in backward)]
    return len(inside), len(reductions)


def _train_and_trace(config):
    return train(config, None, True), _reductions_in_backward(config)


# data parallelism inside the pipeline's backward: ZeRO-3 composed, DDP and ZeRO-2 under pp
# (the tied weight's two ends), HSDP
IN_BACKWARD = [
    dict(dp=2, tp=2, zero=3),
    dict(pp=2, dp=2, zero=3, microbatches=2),
    dict(pp=2, dp=2, microbatches=2),
    dict(pp=2, dp=2, zero=2, microbatches=2, schedule="zb_h1"),
    dict(dp=4, dp_replicate=2, zero=3),
]


@pytest.mark.parametrize("parallel", IN_BACKWARD,
                         ids=[" ".join(f"{k}={v}" for k, v in p.items()) for p in IN_BACKWARD])
def test_data_parallelism_reduces_inside_the_pipelines_backward(cluster4, corpus,  # noqa: F811
                                                                one_process, parallel):
    config = tiny(corpus, **parallel)
    results = cluster4.run(_train_and_trace, config)
    _assert_same_run([run for run, _ in results], one_process, config)
    for r, (_, (inside, total)) in enumerate(results):
        assert total > 0 and inside == total, (parallel, r, inside, total)


def test_hidden_and_exposed_splits_a_reduction_by_the_compute_under_it():
    """A DDP bucket on the communication thread under a B is hidden where they overlap;
    a reduce-scatter on the main thread, even inside a B, pauses it: exposed."""
    events = [Event(0, "B", "0B1", 0.0, 10.0),
              Event(0, "all_reduce", "bucket 0", 6.0, 14.0, thread=1),  # 4 hidden, 4 after
              Event(0, "reduce_scatter", "reduce-scatter bucket 0", 2.0, 3.0),  # inside B
              Event(0, "all_reduce", "bucket 1", 2.5, 3.5, thread=1)]  # under the pause
    hidden, exposed = hidden_and_exposed(events)
    assert math.isclose(hidden, 4.0 + 0.5) and math.isclose(exposed, 4.0 + 1.0 + 0.0)


def _norms(config) -> tuple[float, float]:
    """One step's global gradient norm as the trainer counts it, and as it would be summed
    over every data-parallel rank, the replica groups included (torchtitan#2318's bug)."""
    from minipar.train.precision import LossScaler

    part = build_part(config)
    part.forward_backward(*sampler_for(config, part).next(), config.train.batch_size,
                             LossScaler(False), last=True)
    part.reduce_gradients()
    grads, groups = part.norm_gradients(), part.norm_groups()
    return global_norm(grads, groups), global_norm(grads, [*groups, part.groups.replicate])


def test_hsdp_counts_each_entry_once_in_the_norm(cluster4, corpus):  # noqa: F811
    """Under HSDP each slice lives once per replica group: summed over the replicas too,
    the norm would come out sqrt(2) too large."""
    right, wrong = cluster4.run(_norms, tiny(corpus, dp=4, dp_replicate=2, zero=3))[0]
    assert math.isclose(wrong, right * math.sqrt(2), rel_tol=1e-12)


def test_dp_pp_tp_interleaved_with_zero3_and_sequence_parallel_on_8_ranks(corpus):  # noqa: F811
    """Everything at once: dp2 x pp2 x tp2, interleaved 1F1B with two stages per rank,
    ZeRO-3 (FSDP over the dp group of each tensor-parallel stage), sequence parallelism,
    an untied head."""
    ref = minipar.launch(train, 1, _deep(tiny(corpus)), None, True)[0]
    config = _deep(tiny(corpus, dp=2, pp=2, tp=2, zero=3, sequence_parallel=True,
                        schedule="interleaved_1f1b", virtual=2, microbatches=2))
    # a hang guard: eight ranks and their communication threads on two busy cores took 45 s
    _assert_same_run(minipar.launch(train, 8, config, None, True, timeout=300), ref, config)


def _v(config, tied):
    """Four layers for a V's four stages on pp=2, the batch in four micro-batches."""
    return replace(config, model=replace(config.model, layers=4, tied=tied),
                   train=replace(config.train, accumulation=1))


def test_a_v_schedule_with_the_tied_weight_on_one_rank_trains_as_one_process(
        cluster2, corpus):  # noqa: F811
    """DualPipeV puts the embedding (stage 0) and the tied head (stage 3) on pp rank 0:
    one Parameter there, whose two gradients add up in .grad with nothing to send."""
    ref = minipar.launch(train, 1, _v(tiny(corpus), True), None, True)[0]
    config = _v(tiny(corpus, pp=2, schedule="dualpipev", virtual=2, microbatches=4), True)
    _assert_same_run(cluster2.run(train, config, None, True), ref, config)


def test_a_v_schedule_with_data_parallelism_trains_as_one_process(cluster4, corpus):  # noqa: F811
    """ZB-V inside dp=2 with ZeRO-2 (untied: a V's one shared weight on one rank under
    data parallelism is refused, below)."""
    ref = minipar.launch(train, 1, _v(tiny(corpus), False), None, True)[0]
    config = _v(tiny(corpus, pp=2, dp=2, zero=2, schedule="zb_v", virtual=2,
                     microbatches=4), False)
    _assert_same_run(cluster4.run(train, config, None, True), ref, config)
    tied = _v(tiny(corpus, pp=2, dp=2, zero=1, schedule="dualpipev", virtual=2,
                   microbatches=4), True)
    with pytest.raises(minipar.RankError, match="untie them"):
        cluster4.run(train, tied, None, True)


def _moe(config):
    """Every block's feed-forward a dropless mixture of 4 experts (top-2)."""
    return replace(config, model=replace(config.model, experts=4))


@pytest.fixture(scope="module")
def one_process_moe(corpus):  # noqa: F811
    return minipar.launch(train, 1, _moe(tiny(corpus)), None, True)[0]


@pytest.mark.parametrize("ranks, parallel", [
    (2, dict(dp=2, ep=2)),
    (4, dict(pp=2, dp=2, ep=2, zero=1, microbatches=2)),
])
def test_experts_over_ep_inside_dp_train_as_one_process(cluster2, cluster4, corpus,  # noqa: F811
                                                        one_process_moe, ranks, parallel):
    """The mixture-of-experts decoder with its experts split over ep (all-to-all), the
    dense weights averaged over dp and ep, beside pp and ZeRO-1."""
    config = _moe(tiny(corpus, **parallel))
    cluster = cluster2 if ranks == 2 else cluster4
    _assert_same_run(cluster.run(train, config, None, True), one_process_moe, config)


def _saved_activation_peak(config) -> int:
    """Bytes autograd kept for backward at the peak of two steps, on this rank."""
    from minipar.train.precision import LossScaler

    part = build_part(config)
    part.model.pipe.measure_activations = True  # the trainer's timed steps leave it off
    sampler = sampler_for(config, part)
    for _ in range(2):
        part.forward_backward(*sampler.next(), config.train.batch_size,
                                 LossScaler(False), last=True)
    return part.model.pipe.activations.peak


def test_recomputation_inside_the_pipeline_keeps_less(cluster2, corpus):  # noqa: F811
    """Full recomputation through the engine keeps each block's input only: the measured
    saved activations fall several times; selective keeps less than none."""
    base = _deep(tiny(corpus, pp=2, microbatches=2))
    peaks = {policy: max(cluster2.run(_saved_activation_peak, replace(
        base, train=replace(base.train, recompute=policy))))
        for policy in ("none", "selective", "full")}
    assert peaks["full"] * 3 < peaks["none"], peaks
    assert peaks["selective"] < peaks["none"], peaks


def test_the_overlap_bench_splits_each_reduction_into_hidden_and_exposed(tmp_path):
    """ZeRO-1 reduces after backward on the main thread: nothing of it can be hidden;
    every layout reduces something."""
    from minipar.train.overlap_bench import MOMENTS, measure, report

    rows = measure(steps=3, rounds=1, preset="tiny", meshes=("pp=2 x dp=2, 4 micro-batches",))
    assert len(rows) == len(MOMENTS)
    for row in rows:
        assert row["hidden"] + row["exposed"] > 0, row
        if row["moment"].startswith("ZeRO-1"):
            assert row["hidden"] == 0 and row["vs_zero1"] == [1.0], row
    assert "step vs ZeRO-1" in report(rows, tmp_path)
    assert (tmp_path / "bench_dp_overlap.json").exists()


DOCS = Path(__file__).resolve().parents[1] / "docs" / "composition.md"


@pytest.mark.slow  # a trainer command per composition
@pytest.mark.parametrize("command", re.findall(r"^\.venv/bin/(minipar train .+)$",
                                               DOCS.read_text(), re.MULTILINE))
def test_every_train_command_in_the_composition_page_runs(command, tmp_path):
    """The page's commands, as a reader types them (without its virtual environment; in a
    folder of their own: they write runs/latest)."""
    done = subprocess.run([sys.executable, "-m", *command.split()], capture_output=True,
                          text=True, timeout=170, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step     5/5" in done.stdout, done.stdout[-2000:]
