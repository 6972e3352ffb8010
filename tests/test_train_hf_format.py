"""Hugging Face's Llama format, both ways: a run exported with --format hf loads in
transformers with the same logits and the same greedy text; a Llama that transformers saved
starts a minipar run on any mesh (ZeRO-3 with tp and pp, HSDP) with transformers' own loss
at step 1 and one process's curve after it; what minipar cannot represent is one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import minipar
from minipar.decoder import DecoderConfig
from minipar.generation import generate
from minipar.train.__main__ import main as train_main
from minipar.train.compare import first_with_losses
from minipar.train.config import DataConfig, LoopConfig, OptimConfig, ParallelConfig, TrainConfig
from minipar.train.data import BatchSampler, load_tokens
from minipar.train.export import load_model
from minipar.train.hf_format import llama_config, model_fields, read_hf
from minipar.train.loop import train

transformers = pytest.importorskip("transformers")
from test_train import write_corpus  # noqa: E402  (after the skip: the corpus helper)

# the runs' ranks compute on the faked device (issue 69, conftest.py): --init-from and
# export move weights between the host and the device as on a GPU
pytestmark = pytest.mark.usefixtures("faked_device_on")

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A small randomly initialized Llama, saved by transformers itself (nothing downloaded)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder


def config_from(corpus: str, folder, **parallel) -> TrainConfig:
    """4 float64 steps starting from the Llama in `folder`."""
    fields, _ = read_hf(folder)
    return TrainConfig(
        model=DecoderConfig(seq_len=16, **fields),
        data=DataConfig(path=corpus, val_fraction=0.2, seed=1),
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(lr=3e-3, warmup_steps=1, grad_clip=0.5),
        train=LoopConfig(batch_size=8, steps=4, eval_every=0, eval_batches=1, log_every=10,
                         precision="fp64", init_from=str(folder)))


@pytest.fixture(scope="module")
def from_llama_on_one(corpus, llama_folder):
    return minipar.launch(train, 1, config_from(corpus, llama_folder))[0]


def test_a_transformers_llama_starts_a_run_with_its_own_loss(corpus, llama_folder,
                                                              from_llama_on_one):
    config = config_from(corpus, llama_folder)
    tokens = load_tokens(corpus, 0.2, 1)
    x, y = BatchSampler(tokens.train, 16, 8, 1, 0, 1).next()  # step 1's batch
    model = transformers.LlamaForCausalLM.from_pretrained(llama_folder, dtype=torch.float64)
    ids = torch.cat([x, y[:, -1:]], dim=1)  # transformers shifts the labels itself
    with torch.no_grad():
        theirs = model(ids, labels=ids).loss.item()
    # transformers' RoPE angles and RMSNorm run in float32 even in a float64 model
    assert from_llama_on_one.losses[0] == pytest.approx(theirs, rel=1e-6, abs=0)
    assert config.model.ffn == 96  # the checkpoint's width, not Llama's default 8/3 x hidden


@pytest.mark.parametrize("parallel", [dict(pp=2, tp=2, zero=3),
                                      dict(dp=4, zero=3, dp_replicate=2)],
                         ids=["zero3-pp2-tp2", "hsdp"])
def test_init_from_reshards_onto_any_mesh(corpus, llama_folder, from_llama_on_one, cluster4,
                                          parallel):
    runs = cluster4.run(train, config_from(corpus, llama_folder, **parallel))
    mine, one = first_with_losses(runs).losses, from_llama_on_one.losses
    assert max(abs(a - b) for a, b in zip(mine, one, strict=True)) < 1e-12, (mine, one)


def test_an_exported_run_loads_in_transformers_with_the_same_logits_and_text(corpus,
                                                                             tmp_path):
    config = TrainConfig(
        model=DecoderConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=32),
        data=DataConfig(path=corpus, val_fraction=0.2, seed=1),
        optim=OptimConfig(warmup_steps=1),
        train=LoopConfig(batch_size=4, steps=3, eval_every=0, eval_batches=1))
    minipar.launch(train, 1, config, tmp_path / "run")
    assert train_main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "hf"),
                       "--format", "hf"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    ours, _ = load_model(tmp_path / "run")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (hf(ids).logits - ours(ids)).abs().max().item()
    assert gap < 1e-4, gap  # float32 both; the RoPE angles' rounding differs (hf_format.py)
    prompt = torch.tensor([list(b"def ")])
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0].tolist()
    mine = generate(ours, prompt, 12, 0.0, None, torch.Generator())[0].tolist()
    assert bytes(theirs) == bytes(mine)  # ids are bytes: decoded with bytes()
    assert model_fields(tmp_path / "hf")["tied"] is True


def _saved_config(folder, tmp_path, **changes):
    out = tmp_path / "edited"
    out.mkdir(exist_ok=True)
    c = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        c[key] = value
    (out / "config.json").write_text(json.dumps(c))
    (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize("changes, words", [
    (dict(model_type="mixtral"), ["model_type='mixtral'", "not a Llama"]),
    (dict(attention_bias=True), ["attention_bias=True", "biases"]),
    (dict(mlp_bias=True), ["mlp_bias=True"]),
    (dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     ["rope_parameters.rope_type='llama3'"]),
    (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}),
     ["rope_scaling.rope_type='linear'"]),
    (dict(head_dim=32), ["head_dim=32"]),
])
def test_what_minipar_cannot_represent_is_one_line_naming_the_field(llama_folder, tmp_path,
                                                                    changes, words):
    with pytest.raises(ValueError) as err:
        model_fields(_saved_config(llama_folder, tmp_path, **changes))
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_the_command_line_refuses_in_one_line(llama_folder, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    flags = ["--steps", "1", "--out", str(tmp_path / "run")]
    assert train_main(["--init-from", str(empty), *flags]) != 0
    assert "has no config.json" in capsys.readouterr().err
    assert train_main(["--init-from", str(llama_folder), "--layers", "3", *flags]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.layers=3 was given" in err[0], err
    assert train_main(["--init-from", str(llama_folder), "--experts", "4", *flags]) != 0
    assert "model.experts=4" in capsys.readouterr().err
    moe = TrainConfig(model=DecoderConfig(experts=2, layers=1, hidden=32, heads=2, kv_heads=1))
    with pytest.raises(ValueError, match="model.experts=2: a Llama has no mixture"):
        llama_config(moe.model, torch.float32)


def test_a_config_whose_shape_differs_from_the_checkpoint_is_refused(corpus, llama_folder):
    config = config_from(corpus, llama_folder)
    config = replace(config, model=replace(config.model, hidden=32))
    with pytest.raises(minipar.RankError, match="model.hidden=32 but the checkpoint"):
        minipar.launch(train, 1, config)
