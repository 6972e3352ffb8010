"""Sharded checkpoints: a run stopped and resumed, on the same mesh or another, goes on
exactly as if it had never stopped (float64: every later step's loss and gradient norm,
and the final weights); a write that fails leaves the previous checkpoint in force; a
damaged or foreign checkpoint is one line naming the file."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

import minipar
from minipar.runtime.device import faked_for_task
from minipar.slow_networks.checkpoint_restart import latest_step
from minipar.tensor_parallel import twin_slice
from minipar.train.loop import train
from minipar.train.model_part import trainer_mesh
from minipar.train.sharded_checkpoint import checkpoint_dir, verify_checkpoint

# every rank of these tests computes on the faked device (issue 69, conftest.py)
# slow: trainer jobs that stop and resume on other meshes
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("faked_device_on")]


@pytest.fixture(scope="module")
def uninterrupted(corpus):  # noqa: F811
    return minipar.launch(train, 1, tiny(corpus), None, True)[0]


def _with(config, **parallel):
    return replace(config, parallel=replace(config.parallel, **parallel))


def _same_steps(resumed, reference, first: int) -> None:
    assert [r["step"] for r in resumed.records] == list(range(first + 1, first + 1 +
                                                              len(resumed.records)))
    for mine in resumed.records:
        theirs = reference.records[mine["step"] - 1]
        for key in ("loss", "grad_norm", "val_loss"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-10, abs=1e-12), \
                    (mine["step"], key)


def test_a_run_resumes_on_another_mesh_each_time_as_if_it_never_stopped(
        cluster4, corpus, uninterrupted, tmp_path):  # noqa: F811
    """The issue's chain: saved at dp2 x tp2 with ZeRO-3, resumed under HSDP (ZeRO-3 in two
    groups of two), at pp2 x dp2 with ZeRO-1, then on one process, then at tp2 x cp2:
    Adam's moments reshard with their parameters."""
    base = tiny(corpus)
    chain = [(dict(dp=2, tp=2, zero=3), 4), (dict(dp=4, dp_replicate=2, zero=3), 8),
             (dict(pp=2, dp=2, zero=1), 12), ({}, 16), (dict(tp=2, cp=2), 20)]
    for i, (parallel, stop) in enumerate(chain):
        config = _with(base, **parallel)
        args = (config, tmp_path, True, i > 0, stop)
        runs = cluster4.run(train, *args) if parallel else minipar.launch(train, 1, *args)
        _same_steps(runs[0], uninterrupted, first=chain[i - 1][1] if i else 0)
        assert latest_step(checkpoint_dir(tmp_path)) == stop
    mesh = trainer_mesh(config)
    for r, run in enumerate(runs):  # the final weights, each rank's slice of the twin's
        for name, weight in run.weights.items():
            full = uninterrupted.weights[name]
            assert torch.allclose(weight, twin_slice(full, weight, mesh.coords(r)["tp"], 2),
                                  rtol=1e-9, atol=1e-12), (r, name)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))  # one line per step, no repeats


def test_on_the_same_mesh_a_resume_is_bit_for_bit(cluster2, corpus, tmp_path):  # noqa: F811
    """ZeRO-3's flat slices saved and loaded on the same two ranks: every later step's
    loss is the very same float."""
    config = _with(tiny(corpus), dp=2, zero=3)
    config = replace(config, train=replace(config.train, steps=10, eval_every=5))
    whole = cluster2.run(train, config)[0]
    cluster2.run(train, config, tmp_path, False, False, 4)
    resumed = cluster2.run(train, config, tmp_path, False, True)[0]
    assert resumed.losses == whole.losses[4:]


def _failing_write(config, out, fail_at: int):
    """Train with a checkpoint every 5 steps; rank 1's write at step `fail_at` fails (a
    full disk), as a torch.save that raises halfway."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if minipar.rank() == 1 and f"step-{fail_at}" in str(f):
            Path(f).write_bytes(b"half a fi")
            raise OSError(28, "No space left on device")
        return real(obj, f, *args, **kwargs)

    torch.save = save
    try:
        return train(config, out)
    finally:
        torch.save = real


def test_a_write_that_fails_halfway_leaves_the_previous_checkpoint_latest(corpus, tmp_path):  # noqa: F811
    config = _with(tiny(corpus), dp=2)
    config = replace(config, train=replace(config.train, checkpoint_every=5))
    with pytest.raises(minipar.RankError, match="No space left"):
        minipar.launch(_failing_write, 2, config, tmp_path, 10, timeout=30)
    assert latest_step(checkpoint_dir(tmp_path)) == 5
    assert verify_checkpoint(tmp_path, config) == 5  # and it is whole


@pytest.fixture
def saved(cluster2, corpus, tmp_path):  # noqa: F811
    config = _with(tiny(corpus), dp=2, zero=1)
    cluster2.run(train, config, tmp_path, False, False, 3)
    return config, tmp_path, checkpoint_dir(tmp_path) / "step-3"


def _one_line(config, out, *words):
    with pytest.raises(ValueError) as err:
        verify_checkpoint(out, config)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_truncated_shard_is_one_line_naming_it(saved):
    config, out, folder = saved
    data = (folder / "rank-1.pt").read_bytes()
    (folder / "rank-1.pt").write_bytes(data[: len(data) // 2])
    _one_line(config, out, "rank-1.pt", "unreadable", "latest")


def test_a_missing_rank_file_is_one_line_naming_it(saved):
    config, out, folder = saved
    (folder / "rank-0.pt").unlink()
    _one_line(config, out, "rank-0.pt", "missing")


def test_a_manifest_of_another_model_is_one_line(saved):
    config, out, folder = saved
    other = replace(config, model=replace(config.model, hidden=64))
    _one_line(other, out, "manifest.json", "another model", "model.hidden")
    (folder / "manifest.json").write_text("{not json")
    _one_line(config, out, "manifest.json", "not a readable manifest")


def test_an_export_loads_into_the_one_process_twin_with_plain_torch(cluster4, corpus,  # noqa: F811
                                                                   uninterrupted, tmp_path):
    """Trained on pp2 x tp2 for 10 steps, exported whole: plain torch.load +
    load_state_dict, and the loss on step 11's batch is the loss the uninterrupted run
    reported at step 11 (the weights after 10 steps, on that batch)."""
    from minipar.decoder import decoder
    from minipar.train.config import from_dict
    from minipar.train.data import BatchSampler, load_tokens
    from minipar.train.export import export, sample

    config = _with(tiny(corpus), pp=2, tp=2)
    cluster4.run(train, config, tmp_path / "run", False, False, 10)
    # export and sampling run here, not in a rank: on the faked device here too
    with faked_for_task(True, 0):
        written = export(tmp_path / "run", tmp_path / "model.pt")
        text = sample(written, "def ", 30, seed=3)
    meta = json.loads((tmp_path / "model.pt.json").read_text())
    model = decoder(from_dict(meta["config"]).model, dtype=torch.float64)
    model.load_state_dict(torch.load(written, weights_only=True))  # strict: every key
    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    sampler = BatchSampler(tokens.train, config.model.seq_len, config.train.batch_size,
                           config.data.seed, 0, 1)
    sampler.load_state_dict({"step": 10})
    with torch.no_grad():
        loss = model.loss(*sampler.next()).item()
    assert meta["step"] == 10
    assert loss == pytest.approx(uninterrupted.records[10]["loss"], rel=1e-10)
    # text from the file and from the run folder: seeded, so the same
    assert text.startswith("def ") and text == sample(tmp_path / "run", "def ", 30, seed=3)
    # the same weights as safetensors (the tied head a copy of its own), the same numbers
    from safetensors.torch import load_file

    with faked_for_task(True, 0):
        other = export(tmp_path / "run", tmp_path / "model.safetensors")
    twin = decoder(from_dict(meta["config"]).model, dtype=torch.float64)
    twin.load_state_dict(load_file(other))
    for name, weight in model.state_dict().items():
        assert torch.equal(twin.state_dict()[name], weight), name
    assert sample(other, "def ", 30, seed=3) == text


def _killed_at(config, out, at: int):
    """Train, and SIGKILL rank 1 as it starts step `at` (a worker lost mid-run)."""
    import os
    import signal

    from minipar.train import loop

    real, calls = loop.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if minipar.rank() == 1 and len(calls) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    loop.train_step = step
    return train(config, out)


def test_a_killed_worker_ends_the_job_naming_it_and_a_resume_loses_only_the_steps_since(
        corpus, uninterrupted, tmp_path):  # noqa: F811
    config = _with(tiny(corpus), dp=2, zero=1)
    config = replace(config, train=replace(config.train, checkpoint_every=5))
    with pytest.raises(minipar.RankError) as err:
        minipar.launch(_killed_at, 2, config, tmp_path, 13, timeout=30)
    assert "rank 1" in str(err.value)
    assert latest_step(checkpoint_dir(tmp_path)) == 10  # steps 11 and 12 are lost
    resumed = minipar.launch(train, 1, _with(config, dp=1, zero=0), tmp_path, False, True)[0]
    _same_steps(resumed, uninterrupted, first=10)
