"""The command line over a TrainConfig: a flag for each field a learner changes often, its
help text the field's own docstring, and the flags given turned into dotted overrides.

    parser = OneLineParser(prog="minipar train")
    add_flags(parser)
    args = parser.parse_args()
    config = load_config(args.config, overrides_from_args(args))
"""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
from dataclasses import replace
from functools import cache
from pathlib import Path

from ..cli import nonnegative_int, positive_int
from ..context_parallel.attention_cores import CP_CORES
from ..cost import RECOMPUTE
from ..decoder import BALANCES
from ..pipeline import SCHEDULES
from ..runtime import BACKENDS, DEFAULT_TIMEOUT, DEVICES
from .config import PRECISIONS, SECTIONS, TrainConfig, tomllib


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0; got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0; got {value}")
    return value


# flag -> (dotted field, argparse keywords). Every default is None: a flag left out keeps the
# config file's value.
FLAGS: dict[str, tuple[str, dict]] = {
    "--dp": ("parallel.dp", {"type": positive_int}),
    "--pp": ("parallel.pp", {"type": positive_int}),
    "--tp": ("parallel.tp", {"type": positive_int}),
    "--cp": ("parallel.cp", {"type": positive_int}),
    "--cp-kind": ("parallel.cp_kind", {"choices": tuple(CP_CORES)}),
    "--ep": ("parallel.ep", {"type": positive_int}),
    "--zero": ("parallel.zero", {"type": int, "choices": (0, 1, 2, 3)}),
    "--dp-replicate": ("parallel.dp_replicate", {"type": positive_int}),
    "--schedule": ("parallel.schedule", {"choices": tuple(SCHEDULES)}),
    "--microbatches": ("parallel.microbatches", {"type": positive_int}),
    "--virtual": ("parallel.virtual", {"type": positive_int}),
    "--sequence-parallel": ("parallel.sequence_parallel",
                            {"action": argparse.BooleanOptionalAction}),
    "--precision": ("train.precision", {"choices": PRECISIONS}),
    "--recompute": ("train.recompute", {"choices": RECOMPUTE}),
    "--compile": ("train.compile", {"action": argparse.BooleanOptionalAction}),
    "--steps": ("train.steps", {"type": positive_int}),
    "--batch-size": ("train.batch_size", {"type": positive_int}),
    "--accumulation": ("train.accumulation", {"type": positive_int}),
    "--lr": ("optim.lr", {"type": _positive_float}),
    "--warmup-steps": ("optim.warmup_steps", {"type": nonnegative_int}),
    "--seed": ("train.seed", {"type": nonnegative_int}),
    "--init-from": ("train.init_from", {"metavar": "DIR"}),
    "--checkpoint-every": ("train.checkpoint_every", {"type": nonnegative_int}),
    "--data": ("data.path", {"metavar": "PATH"}),
    "--layers": ("model.layers", {"type": positive_int}),
    "--hidden": ("model.hidden", {"type": positive_int}),
    "--heads": ("model.heads", {"type": positive_int}),
    "--kv-heads": ("model.kv_heads", {"type": positive_int}),
    "--seq-len": ("model.seq_len", {"type": positive_int}),
    "--experts": ("model.experts", {"type": nonnegative_int}),
    "--top-k": ("model.top_k", {"type": positive_int}),
    "--balance": ("model.balance", {"choices": BALANCES}),
    "--balance-coef": ("model.balance_coef", {"type": float}),
    "--bias-rate": ("model.bias_rate", {"type": float}),
}


@cache
def _docstrings(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string right under it), read from the source."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):  # no source shipped: flags without help text
        return {}
    docs = {}
    for node, after in zip(body, body[1:], strict=False):  # each node and the next
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--config and a flag per common field; help from each field's docstring."""
    group = parser.add_argument_group("configuration (flags override the config file)")
    group.add_argument("--config", default="tiny", metavar="NAME_OR_TOML",
                       help="a preset (tiny, small) or a .toml file (default: tiny)")
    for flag, (dotted, keywords) in FLAGS.items():
        section, key = dotted.split(".")
        doc = _docstrings(SECTIONS[section]).get(key, "")
        if "choices" not in keywords and "action" not in keywords:
            keywords = {"metavar": key.upper(), **keywords}
        group.add_argument(flag, dest=dotted.replace(".", "__"), default=None,
                           help=f"{doc} [{dotted}]".replace("%", "%%"), **keywords)


def overrides_from_args(args: argparse.Namespace) -> dict:
    """{dotted name: value} for each flag that was given."""
    given = {dotted: getattr(args, dotted.replace(".", "__"), None)
             for dotted, _ in FLAGS.values()}
    return {dotted: value for dotted, value in given.items() if value is not None}


def fit_warmup(config: TrainConfig, name_or_path: str, overrides: dict
               ) -> tuple[TrainConfig, str | None]:
    """`--steps 20` on a preset whose warmup is 50 trains, with the warmup scaled to a
    tenth of the run and a note saying so. A warmup the user wrote (by --warmup-steps or in
    their own .toml) is theirs: if it does not fit, `check` refuses it in one line."""
    steps, warmup = config.train.steps, config.optim.warmup_steps
    if warmup <= steps or "optim.warmup_steps" in overrides:
        return config, None
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():  # the user's own file, not a preset
        table = tomllib.loads(path.read_text(encoding="utf-8")).get("optim", {})
        if isinstance(table, dict) and "warmup_steps" in table:
            return config, None
    fitted = steps // 10  # linear warmup over the first tenth, as long runs often do
    note = (f"note: {steps} steps is shorter than the config's {warmup} warmup steps; "
            f"warming up over {fitted} instead (set --warmup-steps to choose)")
    return replace(config, optim=replace(config.optim, warmup_steps=fitted)), note


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """--backend, --device and --timeout: how the spawned ranks talk, where they compute,
    and how long they may wait."""
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: NCCL with a GPU per rank if there are enough, else gloo")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: a GPU per rank under NCCL, else the CPU; cuda with "
                             "--backend gloo: every rank on the GPUs there are (several "
                             "ranks may share one)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds with no progress on any rank (no message, step or "
                             f"computation ending) before the run is called stuck (default "
                             f"{DEFAULT_TIMEOUT:g})")
