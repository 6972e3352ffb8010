"""A trained model you can keep and read: `minipar train export RUN --to FILE` turns the
run's latest sharded checkpoint into one plain state_dict (and its config as JSON beside
it) that the one-process twin loads with `torch.load` + `load_state_dict`, no minipar
mesh needed; `minipar train sample RUN_OR_FILE --prompt "def "` writes text with it.

`--format hf` writes a folder transformers loads as a Llama instead (hf_format.py).
FILE ending in `.safetensors` is written with the safetensors package when it is
installed (no pickle: a file anyone can load safely); anything else with torch.save.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..cli import OneLineParser, nonnegative_int, positive_int, run_command
from ..generation import generate
from ..moe.moe_decoder import moe_decoder
from .config import TrainConfig, from_dict, to_dict
from .data import ByteTokenizer
from .hf_format import export_hf
from .sharded_checkpoint import consolidate


def export(run: str | Path, to: str | Path) -> Path:
    """Write the run's latest checkpoint whole to `to` and its config to `to`.json; the
    written file's path."""
    config, step, state = consolidate(run)
    to = Path(to)
    to.parent.mkdir(parents=True, exist_ok=True)
    if to.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("--to *.safetensors needs the safetensors package (pip install "
                             "safetensors); or write a .pt file") from None
        # safetensors stores no shared tensors: the tied head gets a copy of its own
        save_file({k: v.clone().contiguous() for k, v in state.items()}, to)
    else:
        torch.save(state, to)
    meta = {"step": step, "config": to_dict(config)}
    to.with_name(to.name + ".json").write_text(json.dumps(meta, indent=1))
    return to


def load_model(source: str | Path) -> tuple[torch.nn.Module, TrainConfig]:
    """The one-process twin with a run's weights: from an exported file (and its .json) or
    from a run folder's latest checkpoint."""
    source = Path(source)
    if source.is_dir():
        config, _, state = consolidate(source)
    else:
        meta_path = source.with_name(source.name + ".json")
        if not source.is_file() or not meta_path.is_file():
            raise ValueError(f"{source} must be a run folder or a file written by minipar train "
                             f"export (with {meta_path.name} beside it)")
        config = from_dict(json.loads(meta_path.read_text())["config"], meta_path.name)
        if source.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(source)
        else:
            state = torch.load(source, weights_only=True)
    model = moe_decoder(config.model, dtype=next(iter(state.values())).dtype)
    model.load_state_dict(state)
    return model.eval(), config


def sample(source: str | Path, prompt: str, tokens: int, temperature: float = 0.8,
           top_k: int | None = 40, seed: int = 0) -> str:
    """`tokens` bytes of text after `prompt`, sampled with a key/value cache, seeded."""
    model, _ = load_model(source)
    tokenizer = ByteTokenizer()
    ids = torch.tensor([tokenizer.encode(prompt or "\n")], device=model.embed.weight.device)
    out = generate(model, ids, tokens, temperature, top_k,
                   torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0].tolist())


def export_main(argv: list[str], prog: str) -> int:
    p = OneLineParser(prog=prog, description="Write a run's latest checkpoint as one "
                      "state_dict the one-process twin loads with plain torch.")
    p.add_argument("run", help="the run folder (--out of minipar train)")
    p.add_argument("--to", required=True, help="the file to write (.pt, or .safetensors), "
                   "or with --format hf the folder")
    p.add_argument("--format", choices=("minipar", "hf"), default="minipar",
                   help="minipar: one state_dict and its config; hf: a Llama folder that "
                        "transformers' LlamaForCausalLM.from_pretrained loads")
    args = p.parse_args(argv)

    def body() -> int:
        if args.format == "hf":
            written = export_hf(args.run, args.to)
            print(f"wrote {written}/config.json and model.safetensors (a Llama for transformers)")
            return 0
        written = export(args.run, args.to)
        print(f"wrote {written} and {written.name}.json")
        return 0

    return run_command(prog, body)


def _temperature(text: str) -> float:
    """argparse type: a number >= 0 (0: greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy); got {text}")
    return value


def sample_main(argv: list[str], prog: str) -> int:
    p = OneLineParser(prog=prog, description="Sample text from a run's weights.")
    p.add_argument("source", help="a run folder, or a file written by minipar train export")
    p.add_argument("--prompt", default="def ", help="the text to continue (default 'def ')")
    p.add_argument("--tokens", type=positive_int, default=200, help="bytes to write")
    p.add_argument("--temperature", type=_temperature, default=0.8,
                   help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=positive_int, default=40, help="sample from the k likeliest")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the sampling seed")
    args = p.parse_args(argv)

    def body() -> int:
        print(sample(args.source, args.prompt, args.tokens, args.temperature, args.top_k,
                     args.seed))
        return 0

    return run_command(prog, body)

