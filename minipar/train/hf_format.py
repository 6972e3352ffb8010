"""Hugging Face's Llama format, both ways. minipar's decoder is a Llama: pre-norm blocks
with RMSNorm, rotate-half rotary embeddings, SwiGLU, grouped-query attention, no biases.
So its weights only change names:

    embed.weight                 <-> model.embed_tokens.weight
    blocks.i.attn_norm.weight    <-> model.layers.i.input_layernorm.weight
    blocks.i.attn.q_proj.weight  <-> model.layers.i.self_attn.q_proj.weight  (k, v, o alike)
    blocks.i.mlp_norm.weight     <-> model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.gate.weight     <-> model.layers.i.mlp.gate_proj.weight     (up, down alike)
    norm.weight, head.weight     <-> model.norm.weight, lm_head.weight

- `export_hf(run, to)` writes a run's latest checkpoint as `to`/config.json and
  `to`/model.safetensors: `transformers.LlamaForCausalLM.from_pretrained(to)` loads it.
- `read_hf(folder)` reads a Llama checkpoint that transformers saved: the DecoderConfig
  fields it fixes, and its weights under minipar's names. What minipar's decoder cannot
  represent (biases, experts, scaled RoPE, another activation) is one line naming the field.
  The trainer's `train.init_from` starts a run from it on any mesh
  (`sharded_checkpoint.load_whole` hands each rank its pieces).

Numerics: the two compute the same function, not the same rounding. transformers builds
RoPE's angles and RMSNorm's mean of squares in float32 whatever the model's dtype, where
minipar builds the angles in float64 (then casts) and keeps float64 models in float64.
In float32 the logits agree to float32's precision (the tests hold 1e-4); a float64
model agrees only that far, not to float64's 1e-12.

minipar's tokenizer is bytes (ids 0-255) and transformers has no byte tokenizer to match:
generate from ids there, and decode them with `bytes(ids)`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..decoder import DecoderConfig
from .config import TrainConfig
from .sharded_checkpoint import consolidate


def llama_names(layers: int) -> dict[str, str]:
    """minipar's name -> Llama's, for every tensor of a decoder of `layers` blocks."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    block = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             **{f"attn.{x}_proj": f"self_attn.{x}_proj" for x in "qkvo"},
             **{f"mlp.{x}": f"mlp.{x}_proj" for x in ("gate", "up", "down")}}
    for i in range(layers):
        names.update({f"blocks.{i}.{ours}.weight": f"model.layers.{i}.{theirs}.weight"
                      for ours, theirs in block.items()})
    return names


def llama_config(m: DecoderConfig, dtype: torch.dtype) -> dict:
    """transformers' LlamaConfig, as config.json, for the decoder `m`."""
    if m.experts:
        raise ValueError(f"model.experts={m.experts}: a Llama has no mixture of experts; export "
                         "this run with --format pt")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden, "intermediate_size": m.ffn,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        # transformers 5 reads rope_parameters, 4 reads rope_theta: both, the same base
        "rope_theta": m.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_base},
        "tie_word_embeddings": m.tied, "attention_bias": False, "mlp_bias": False,
        # bytes have no special tokens: no id ends a generation early
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_hf(run: str | Path, to: str | Path) -> Path:
    """The run's latest checkpoint as a Llama folder `to` (config.json, model.safetensors)."""
    config, _, state = consolidate(run)
    dtype = state["embed.weight"].dtype
    described = llama_config(config.model, dtype)
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError("--format hf writes model.safetensors: pip install safetensors") from None
    names = llama_names(config.model.layers)
    if config.model.tied:  # transformers ties lm_head to the embedding; one copy is stored
        state = {k: v for k, v in state.items() if k != "head.weight"}
    to = Path(to)
    to.mkdir(parents=True, exist_ok=True)
    save_file({names[k]: v.contiguous() for k, v in state.items()}, to / "model.safetensors",
              metadata={"format": "pt"})  # transformers asks for the "pt" tag
    (to / "config.json").write_text(json.dumps(described, indent=2))
    return to


def _refuse(where: Path, field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{where}: {field}={value!r} {why}, which minipar's decoder cannot "
                      "represent; start from a plain Llama")


def model_fields(folder: str | Path) -> dict:
    """The DecoderConfig fields a transformers Llama folder fixes (its config.json), or one
    line naming the field that minipar's decoder cannot represent."""
    where = Path(folder) / "config.json"
    if not where.is_file():
        raise ValueError(f"{folder} has no config.json: train.init_from takes a folder that "
                         "transformers' save_pretrained wrote (config.json, model.safetensors)")
    c = json.loads(where.read_text(encoding="utf-8"))
    if c.get("model_type") != "llama":
        raise _refuse(where, "model_type", c.get("model_type"), "is not a Llama")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            raise _refuse(where, field, True, "adds biases")
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", c["hidden_act"], "is not SwiGLU's silu")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        field = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
        raise _refuse(where, f"{field}.rope_type", kind, "scales the rotary embedding")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise _refuse(where, "head_dim", head_dim, f"is not hidden_size / num_attention_heads "
                      f"= {hidden} / {heads}")
    return {"vocab_size": c["vocab_size"], "layers": c["num_hidden_layers"], "hidden": hidden,
            "heads": heads, "kv_heads": c.get("num_key_value_heads") or heads,
            "ffn_hidden": c["intermediate_size"], "tied": bool(c.get("tie_word_embeddings")),
            "rope_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            "norm_eps": float(c.get("rms_norm_eps", 1e-6))}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors (or its shards, by the index)."""
    from safetensors.torch import load_file
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(folder / f).items()}
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    raise ValueError(f"{folder} has no model.safetensors; save the model with transformers' "
                     "save_pretrained (safe_serialization, its default)")


def read_hf(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(DecoderConfig fields, state_dict under minipar's names) of a transformers Llama."""
    folder = Path(folder)
    fields = model_fields(folder)
    theirs = _weights(folder)
    names = llama_names(fields["layers"])
    if fields["tied"]:
        del names["head.weight"]  # one tensor, stored as the embedding
    missing = [t for t in names.values() if t not in theirs]
    # old checkpoints also store the rotary tables, which minipar computes
    unknown = [t for t in theirs if t not in names.values() and not t.endswith("inv_freq")
               and not (fields["tied"] and t == "lm_head.weight")]
    if missing or unknown:
        what = f"lacks {missing[0]}" if missing else f"holds {unknown[0]}"
        raise ValueError(f"{folder / 'model.safetensors'} {what}, which a Llama of "
                         f"{fields['layers']} layers would not; is it another architecture?")
    return fields, {ours: theirs[t] for ours, t in names.items()}


def _refuse_experts(config: TrainConfig) -> None:
    if config.model.experts:
        raise ValueError(f"model.experts={config.model.experts}: train.init_from loads a Llama, "
                         "which has no experts; set model.experts = 0")


def fit_model(config: TrainConfig, fields: dict) -> TrainConfig:
    """`config` with the model's shape taken from a checkpoint's `fields` (training's own
    choices, seq_len and the mixture-of-experts fields, stay)."""
    _refuse_experts(config)
    return replace(config, model=replace(config.model, **fields))


def refuse_other_shape(config: TrainConfig, fields: dict) -> None:
    """One line naming the first model field where `config` differs from the checkpoint
    (the fields `model_fields` read from it), or that it cannot load at all."""
    _refuse_experts(config)
    for name in fields:
        # ffn_hidden 0 means Llama's own width: compare the width it resolves to
        ours = config.model.ffn if name == "ffn_hidden" else getattr(config.model, name)
        if ours != fields[name]:
            raise ValueError(f"model.{name}={ours!r} but the checkpoint "
                             f"in train.init_from has {fields[name]!r}; leave model.{name} out "
                             "and it is taken from the checkpoint")
