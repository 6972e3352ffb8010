"""The trainer's configuration: presets load and pass, flags override, TOML round-trips,
and every impossible combination is one line naming the parameter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minipar.cli import OneLineParser
from minipar.train.config import (
    TrainConfig,
    check,
    describe,
    from_dict,
    load_config,
    same_run,
    to_dict,
    to_toml,
)
from minipar.train.flags import add_flags, overrides_from_args


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for word in words:
        assert word in text, (word, text)


def _with(config: TrainConfig, **changes: dict) -> TrainConfig:
    """config with some fields of some sections changed: _with(c, parallel={"dp": 2})."""
    return replace(config, **{s: replace(getattr(config, s), **v) for s, v in changes.items()})


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_presets_load_and_pass_on_one_rank(preset):
    config = load_config(preset)
    check(config, world_size=1)
    assert config.model.layers == {"tiny": 2, "small": 4}[preset]
    assert "tokens per step" in describe(config)


def test_flags_override_the_preset():
    parser = OneLineParser(prog="minipar train")
    add_flags(parser)
    args = parser.parse_args("--config tiny --dp 2 --pp 2 --tp 2 --cp 1 --zero 1 --precision "
                             "bf16 --recompute selective --steps 300 --lr 0.01 "
                             "--sequence-parallel --data /tmp/x.txt --seq-len 32".split())
    config = load_config(args.config, overrides_from_args(args))
    p, t = config.parallel, config.train
    assert (p.dp, p.pp, p.tp, p.cp, p.zero, p.sequence_parallel) == (2, 2, 2, 1, 1, True)
    assert (t.precision, t.recompute, t.steps) == ("bf16", "selective", 300)
    assert config.optim.lr == 0.01 and config.data.path == "/tmp/x.txt"
    assert config.model.seq_len == 32 and config.model.hidden == 64  # the rest from tiny
    check(config, world_size=8)
    assert overrides_from_args(parser.parse_args([])) == {}


def test_a_bad_flag_is_one_line(capsys):
    parser = OneLineParser(prog="minipar train")
    add_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "fp4"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--precision" in err and "bf16" in err


def test_toml_round_trip(tmp_path):
    config = _with(load_config("small"), data={"path": "some 'text\" here.txt"},
                   parallel={"dp": 2, "sequence_parallel": True}, optim={"eps": 1e-12})
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert load_config(str(path)) == config
    assert from_dict(to_dict(config)) == config
    assert load_config(str(path), {"parallel.dp": 4}).parallel.dp == 4
    path.write_text(to_toml(load_config("tiny")))  # data.path None: left out, read back None
    assert load_config(str(path)) == load_config("tiny")


@pytest.mark.parametrize("text, words", [
    ("[parallel]\ndpp = 2\n", ["parallel.dpp", "dp, pp, tp"]),
    ("[paralel]\ndp = 2\n", ["[paralel]", "parallel"]),
    ("steps = 2\n", ["[steps]", "train"]),
    ("[parallel]\ndp = 2.5\n", ["parallel.dp in bad.toml", "whole number", "2.5"]),
    ("[parallel]\ndp = true\n", ["parallel.dp", "whole number"]),
    ("[parallel]\nsequence_parallel = 1\n", ["parallel.sequence_parallel", "true or false"]),
    ("[train]\nprecision = 16\n", ["train.precision", "string"]),
    ("[optim]\nlr = \"fast\"\n", ["optim.lr", "number"]),
    ("[optim\nlr = 1\n", ["not valid TOML"]),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(str(path))
    _one_line(err, *words)


def test_bad_names_are_one_line():
    with pytest.raises(ValueError) as err:
        load_config("huge")
    _one_line(err, "tiny", "small", "'huge'")
    with pytest.raises(ValueError) as err:
        load_config("tiny", {"parallel.dq": 2})
    _one_line(err, "parallel.dq", "dp")
    with pytest.raises(ValueError) as err:
        load_config("tiny", {"dp": 2})
    _one_line(err, "parallel.dp")


def test_an_int_reads_as_a_float(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = 1\n")
    lr = load_config(str(path)).optim.lr
    assert lr == 1.0 and isinstance(lr, float)


IMPOSSIBLE = [  # (changes to tiny, world size, words the one line must hold)
    ({"parallel": {"dp": 2, "tp": 2}}, 2, ["dp x pp x tp x cp", "4 ranks", "there are 2"]),
    ({"parallel": {"tp": 3}}, None, ["tp=3", "heads=4", "kv_heads=2", "[1, 2]"]),
    ({"parallel": {"pp": 4}}, None, ["parallel.pp=4", "model.layers=2", "pp <= 2"]),
    ({"parallel": {"pp": 2, "virtual": 2, "schedule": "looped_bfs"}}, None,
     ["pp x virtual", "model.layers=2"]),
    ({"parallel": {"pp": 2, "virtual": 2, "schedule": "interleaved_1f1b"},
      "model": {"layers": 6}}, None, ["model.layers=6", "virtual in [1, 3]"]),
    ({"parallel": {"pp": 2, "microbatches": 3, "schedule": "interleaved_1f1b"},
      "train": {"batch_size": 18}}, None, ["interleaved_1f1b", "microbatches"]),
    ({"parallel": {"virtual": 2}, "model": {"layers": 4}}, None, ["1f1b", "virtual"]),
    ({"parallel": {"dp": 2, "microbatches": 3}}, None,
     ["train.batch_size=16", "dp x microbatches x accumulation", "multiple of 6", "12 or 18"]),
    ({"train": {"accumulation": 3}}, None, ["batch_size", "multiple of 3"]),
    ({"parallel": {"cp": 3}}, None, ["seq_len=64", "2 x cp = 6", "60 or 66"]),
    ({"parallel": {"zero": 4}}, None, ["parallel.zero", "0", "3"]),
    ({"parallel": {"schedule": "fastest"}}, None, ["parallel.schedule", "1f1b", "gpipe"]),
    ({"parallel": {"sequence_parallel": True}}, None, ["sequence_parallel", "tp"]),
    ({"parallel": {"dp": 0}}, None, ["parallel.dp", ">= 1"]),
    ({"optim": {"warmup_steps": 3000}}, None, ["warmup_steps", "steps=2000"]),
    ({"optim": {"lr": 0.0}}, None, ["optim.lr", "> 0"]),
    ({"optim": {"min_lr": 0.1}}, None, ["optim.min_lr", "lr=0.003"]),
    ({"optim": {"beta2": 1.0}}, None, ["optim.beta2"]),
    ({"train": {"precision": "int4"}}, None, ["train.precision", "bf16"]),
    ({"train": {"recompute": "some"}}, None, ["train.recompute", "selective"]),
    ({"train": {"steps": 0}}, None, ["train.steps", ">= 1"]),
    ({"data": {"val_fraction": 1.0}}, None, ["data.val_fraction"]),
    ({"model": {"kv_heads": 3}}, None, ["model.kv_heads", "heads (4)"]),
    ({"parallel": {"dp": 2, "ep": 2}}, None, ["parallel.ep=2", "model.experts = 0"]),
    ({"parallel": {"dp": 2, "ep": 2}, "model": {"experts": 3}}, None,
     ["parallel.ep=2", "model.experts=3", "ep in [1]"]),
    ({"parallel": {"dp": 3, "ep": 2}, "model": {"experts": 4}}, None,
     ["parallel.ep=2", "parallel.dp=3", "ep in [1]"]),
    ({"model": {"experts": 4, "top_k": 5}}, None, ["model.experts", "top_k"]),
    ({"parallel": {"dp": 4, "dp_replicate": 2}}, None, ["dp_replicate=2", "HSDP", "zero 1, 2"]),
    ({"parallel": {"dp": 4, "dp_replicate": 3, "zero": 3}}, None,
     ["dp_replicate=3", "dp=4", "[1, 2, 4]"]),
]


@pytest.mark.parametrize("changes, world_size, words", IMPOSSIBLE,
                         ids=[" ".join(f"{k}={v}" for s in c.values() for k, v in s.items())
                              for c, _, _ in IMPOSSIBLE])
def test_an_impossible_combination_is_one_line_naming_it(changes, world_size, words):
    config = _with(load_config("tiny"), **changes)
    with pytest.raises(ValueError) as err:
        check(config, world_size)
    _one_line(err, *words)


@pytest.mark.parametrize("changes, world_size", [
    ({"parallel": {"dp": 2, "pp": 2, "tp": 2, "zero": 3}, "train": {"precision": "bf16"}}, 8),
    ({"parallel": {"tp": 2, "sequence_parallel": True, "cp": 2}}, 4),
    ({"parallel": {"pp": 2, "virtual": 2, "schedule": "interleaved_1f1b", "microbatches": 4},
      "model": {"layers": 4}}, 2),
    ({"parallel": {"zero": 3}, "train": {"precision": "fp16", "accumulation": 4}}, 1),
    ({"parallel": {"dp": 4, "ep": 2, "pp": 2, "microbatches": 2}, "model": {"experts": 4}}, 8),
])
def test_possible_combinations_pass(changes, world_size):
    check(_with(load_config("tiny"), **changes), world_size)


def test_same_run_names_what_changed_and_ignores_the_cadence():
    tiny = load_config("tiny")
    assert same_run(tiny, tiny) == []
    longer = _with(tiny, train={"steps": 1000, "eval_every": 7, "log_every": 3})
    assert same_run(tiny, longer) == []
    other = _with(longer, model={"hidden": 128}, optim={"lr": 1e-3})
    assert same_run(tiny, other) == ["model.hidden", "optim.lr"]


def test_a_short_run_scales_the_presets_warmup_but_keeps_the_users(tmp_path):
    from minipar.train.flags import fit_warmup

    short = {"train.steps": 20}
    config, note = fit_warmup(load_config("tiny", short), "tiny", short)
    assert config.optim.warmup_steps == 2 and "warming up over 2" in note
    check(config, 1)  # it trains
    # a warmup that fits, or one the user chose, is left as it is
    config, note = fit_warmup(load_config("tiny"), "tiny", {})
    assert config.optim.warmup_steps == 50 and note is None
    chosen = {"train.steps": 20, "optim.warmup_steps": 30}
    config, note = fit_warmup(load_config("tiny", chosen), "tiny", chosen)
    assert config.optim.warmup_steps == 30 and note is None
    own = tmp_path / "own.toml"
    own.write_text("[optim]\nwarmup_steps = 40\n[train]\nsteps = 20\n")
    config, note = fit_warmup(load_config(str(own)), str(own), {})
    assert note is None
    with pytest.raises(ValueError, match="warmup_steps must be between 0 and train.steps=20"):
        check(config, 1)
    # a file of the user's that leaves the warmup to the default is scaled like a preset
    own.write_text("[train]\nsteps = 20\n")
    config, note = fit_warmup(load_config(str(own)), str(own), {})
    assert config.optim.warmup_steps == 2 and note
