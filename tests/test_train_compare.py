"""`minipar train compare`: compositions that are right match one process to 1e-10 in
float64 (exit 0), a configuration that is not the same run is caught (exit 1), bad
syntax is one line (exit 2), and the table, compare.json and compare.png are written."""

import json
import math

import pytest
from test_train import write_corpus

from minipar.__main__ import main as minipar_main
from minipar.decoder import DecoderConfig
from minipar.train.__main__ import main as train_main
from minipar.train.compare import compare_losses, first_with_losses, parse_overrides
from minipar.train.config import DataConfig, LoopConfig, OptimConfig, TrainConfig, to_toml
from minipar.train.loop import Run

WORDS = "def return import class self lambda yield while for in if else try except with as"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> str:
    """A .toml of a tiny float64 run (2 layers, 6 steps, batch 8) on a small seeded
    corpus: the shared config every configuration overrides."""
    folder = tmp_path_factory.mktemp("compare")
    write_corpus(folder, documents=4, words_per_document=500, words=WORDS)
    config = TrainConfig(
        model=DecoderConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16),
        data=DataConfig(path=str(folder), val_fraction=0.25, seed=1),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, grad_clip=0.5),
        train=LoopConfig(batch_size=8, steps=6, eval_every=0, eval_batches=1, log_every=6,
                         precision="fp64", seed=2))
    path = folder / "tiny.toml"
    path.write_text(to_toml(config))
    return str(path)


@pytest.mark.slow  # the compare command's trainer runs
def test_right_compositions_match_one_process_and_leave_json_and_png(config_file, tmp_path,
                                                                     capsys):
    """dp=2 (DDP buckets) and dp=2 with ZeRO-1 follow one process's curve to 1e-10 at
    every step; the table says so and exit status is 0."""
    code = minipar_main(["train", "compare", "--config", config_file, "--out", str(tmp_path),
                         "dp=2", "dp=2  zero=1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "tolerance 1.0e-10" in printed and "all 2 configuration(s) match" in printed
    saved = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["config"]: r for r in saved["rows"]}
    assert set(rows) == {"one process", "dp=2", "dp=2 zero=1"}
    assert [rows[c]["ranks"] for c in rows] == [1, 2, 2]
    for label in ("dp=2", "dp=2 zero=1"):
        assert rows[label]["matches"] is True
        assert rows[label]["largest_gap"] <= 1e-10
        assert len(rows[label]["losses"]) == 6
        assert f"{label} " in printed
    one = rows["one process"]["losses"]
    assert one[-1] < one[0]  # the model learned: the curves compared are not flat
    assert (tmp_path / "compare.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow  # the compare command's trainer runs
def test_bf16s_tolerance_is_measured_from_two_summation_orders(config_file, tmp_path,
                                                                capsys):
    """In bf16 the bound is a multiple of the gap between one process with accumulation 1
    and 2 (a nonzero number, stated), and dp=2 stays within it."""
    code = train_main(["compare", "--config", config_file, "--out", str(tmp_path),
                       "--precision", "bf16", "dp=2"])
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert code == 0, printed
    assert "accumulation 1 and with 2" in saved["tolerance_why"] in printed
    assert saved["precision"] == "bf16" and saved["tolerance"] >= 1e-4
    assert 0 < saved["rows"][1]["largest_gap"] <= saved["tolerance"]  # bf16 is not exact


@pytest.mark.parametrize("wrong", ["optim.lr=0.004", "train.seed=3"])
@pytest.mark.slow  # the compare command's trainer runs
def test_a_configuration_that_is_another_run_is_caught(config_file, tmp_path, capsys, wrong):
    """Another learning rate or other initial weights, even on one rank, is not the same
    curve: the row says DIFFERS, with the step of the largest gap, and exit status is 1."""
    code = train_main(["compare", "--config", config_file, "--out", str(tmp_path), wrong])
    printed = capsys.readouterr().out
    assert code == 1, printed
    row = json.loads((tmp_path / "compare.json").read_text())["rows"][1]
    assert row["config"] == wrong and row["matches"] is False
    assert row["largest_gap"] > 1e-6 and 1 <= row["at_step"] <= 6
    assert "DIFFERS" in printed and f"differ from one process: {wrong}" in printed


@pytest.mark.parametrize("argument, words", [
    ("dp=two", "parallel.dp in tiny.toml must be a whole number; got 'two'"),
    ("nope=3", "'nope=3': 'nope' is neither a [parallel] key"),
    ("dp", "'dp': 'dp' is not key=value"),
    ("dp=2 dp=1", "sets parallel.dp twice"),
    ("train.nope=1", "unknown key train.nope"),
    ("", "is empty"),
    ("dp=3", "train.batch_size=8 must split into dp x microbatches x accumulation"),
    ("dp=2 model.experts=4", "model.experts changes the model"),
])
def test_bad_configurations_are_one_line(config_file, tmp_path, capsys, argument, words):
    """Each mistake (and what the trainer does not compose yet) is one line naming the
    configuration, exit status 2, before any rank starts."""
    code = train_main(["compare", "--config", config_file, "--out", str(tmp_path), "dp=2",
                       argument])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "\n" not in err and words in err, err
    assert err.startswith("python -m minipar.train compare: configuration")
    assert not (tmp_path / "compare.json").exists()


def test_what_the_trainer_refuses_is_its_one_line_before_any_run(config_file, tmp_path,
                                                                  capsys, monkeypatch):
    """A configuration the trainer does not compose yet (its refusal stood in for here, as
    the trainer grows) is that refusal's line, naming the configuration, exit 2."""
    import minipar.train.compare as compare

    def refuse(config):
        if config.parallel.zero == 2:
            raise ValueError("parallel.zero=2: not composed yet")

    monkeypatch.setattr(compare, "refuse_unbuilt", refuse)
    code = train_main(["compare", "--config", config_file, "--out", str(tmp_path), "dp=2",
                       "dp=2 zero=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not (tmp_path / "compare.json").exists()
    assert err == ("python -m minipar.train compare: configuration 'dp=2 zero=2': "
                   "parallel.zero=2: not composed yet")


def test_no_configuration_is_one_line(capsys):
    assert train_main(["compare"]) == 2
    assert "name at least one configuration" in capsys.readouterr().err


def test_overrides_read_as_toml_values_and_bare_words():
    assert parse_overrides("dp=2 zero=1 train.recompute=full optim.lr=1e-3 "
                           "sequence_parallel=true") == {
        "parallel.dp": 2, "parallel.zero": 1, "train.recompute": "full", "optim.lr": 1e-3,
        "parallel.sequence_parallel": True}


def test_the_gap_is_the_largest_over_the_steps_and_a_nan_is_infinite():
    gap = compare_losses([1.0, 2.5, 3.0], [1.0, 2.0, 3.1])
    assert gap.step == 2 and math.isclose(gap.largest, 0.5)
    assert compare_losses([1.0, math.nan], [1.0, 1.0]).largest == math.inf
    with pytest.raises(ValueError, match="same number of steps"):
        compare_losses([1.0], [1.0, 2.0])


def test_losses_come_from_the_first_rank_that_has_them():
    """With a pipeline only the last stage may know the loss."""
    empty, full = Run(), Run(records=[{"step": 1, "loss": 2.0}])
    assert first_with_losses([empty, full]) is full
    with pytest.raises(RuntimeError, match="none of the 2 ranks"):
        first_with_losses([empty, empty])


def test_the_reference_of_experts_over_ep_is_one_process_with_every_expert():
    """One process keeps the model (its experts) and drops every degree, ep included, so
    `--check` of an expert-parallel run has a reference that can run."""
    from dataclasses import replace

    from minipar.train.compare import one_process
    from minipar.train.config import ParallelConfig, check

    config = TrainConfig(model=DecoderConfig(experts=4),
                         parallel=ParallelConfig(dp=2, ep=2, pp=2, zero=1, microbatches=2))
    check(config, 4)
    reference = one_process(config)
    check(reference, 1)
    assert reference.model == config.model
    assert reference.parallel == replace(ParallelConfig(), microbatches=2)
