"""The trainer's configuration: typed sections with a docstring per field, TOML presets,
overrides by dotted name, and a check that turns every impossible combination into one
line naming the parameter and what would work.

A run is `load_config("tiny", {"parallel.dp": 2})` -> `check(config, world_size)`; the
run folder keeps `to_toml(config)`, and `same_run` says whether a folder holds this run.
"""

from __future__ import annotations

import json
import math
import sys
import typing
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..context_parallel.attention_cores import CP_CORES
from ..context_parallel.ulysses import check_heads
from ..cost import RECOMPUTE
from ..decoder import DecoderConfig
from ..pipeline import SCHEDULES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRESETS = Path(__file__).parent / "presets"
PRECISIONS = ("fp32", "fp64", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class DataConfig:
    """The [data] section: which text, and how it is split."""

    path: str | None = None
    """A text file or folder to train on; None: the Python standard library's sources."""
    val_fraction: float = 0.05
    """Share of the text held out for the validation loss."""
    seed: int = 0
    """Seed of the sampler that picks training sequences."""


@dataclass(frozen=True)
class ParallelConfig:
    """The [parallel] section: the mesh's degrees and how each technique runs."""

    dp: int = 1
    """Data-parallel degree: copies of the model, each on different sequences."""
    pp: int = 1
    """Pipeline-parallel degree: stages the layers are split into."""
    tp: int = 1
    """Tensor-parallel degree: ranks each layer's matrices are split over."""
    cp: int = 1
    """Context-parallel degree: ranks each sequence is split over (cp_kind's attention)."""
    cp_kind: str = "ring"
    """How a cp group attends: ring (keys and values travel) or ulysses (all-to-all to heads)."""
    ep: int = 1
    """Expert-parallel degree, inside dp: each block's experts are split over ep of the dp
    ranks (model.experts > 0); ep divides dp and the experts."""
    zero: int = 0
    """ZeRO stage over dp: 0 plain DDP buckets, 1 optimizer, 2 + gradients, 3 + weights."""
    dp_replicate: int = 1
    """HSDP: the dp ranks form this many groups holding replicas; ZeRO shards inside each
    group of dp / dp_replicate ranks (a reduce-scatter inside, an all-reduce across)."""
    schedule: str = "1f1b"
    """Pipeline schedule, a name from minipar.pipeline.SCHEDULES."""
    microbatches: int = 1
    """Micro-batches each pipeline step splits its batch into."""
    virtual: int = 1
    """Pipeline stages per rank: more than 1 for interleaved schedules, exactly 2 for a V."""
    sequence_parallel: bool = False
    """Split the activations that tensor parallelism keeps whole along the sequence."""


@dataclass(frozen=True)
class OptimConfig:
    """The [optim] section: AdamW with linear warmup and cosine decay."""

    lr: float = 2e-3
    """Peak learning rate, reached at the end of the warmup."""
    min_lr: float = 2e-4
    """Learning rate the cosine decays to at the last step."""
    warmup_steps: int = 50
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (matrices only; norms and embeddings are spared)."""
    beta1: float = 0.9
    """Adam's decay of the gradient's running mean."""
    beta2: float = 0.95
    """Adam's decay of the squared gradient's running mean."""
    eps: float = 1e-8
    """Adam's epsilon, added to the root of the second moment."""
    grad_clip: float = 1.0
    """Largest global gradient norm (across all shards) before scaling down; 0 is off."""


@dataclass(frozen=True)
class LoopConfig:
    """The [train] section: the training loop's batch, length, cadence and numerics."""

    batch_size: int = 32
    """Sequences per optimizer step, over all data-parallel ranks together."""
    accumulation: int = 1
    """Gradient accumulation steps each optimizer step's batch is split into."""
    steps: int = 600
    """Optimizer steps to train for."""
    eval_every: int = 100
    """Steps between validation losses; 0 evaluates only at the end."""
    eval_batches: int = 8
    """Batches each validation loss averages."""
    log_every: int = 20
    """Steps between progress lines."""
    checkpoint_every: int = 0
    """Steps between sharded checkpoints in the run's checkpoints/ (0: only its end saves)."""
    precision: str = "fp32"
    """Compute precision: fp32, fp64, bf16, fp16 or fp8 (emulated; the last three, fp32 masters)."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention scores) or full (each layer)."""
    seed: int = 0
    """Seed of the model's initial weights."""
    init_from: str | None = None
    """A Llama folder transformers saved (config.json, model.safetensors) to start from."""
    compile: bool = False
    """torch.compile each decoder block (compile_blocks.py): slower first step, faster after."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run is: one section per TOML table."""

    model: DecoderConfig = field(default_factory=DecoderConfig)  # the decoder's shape
    data: DataConfig = field(default_factory=DataConfig)  # the text and its split
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the mesh, its techniques
    optim: OptimConfig = field(default_factory=OptimConfig)  # the optimizer and its schedule
    train: LoopConfig = field(default_factory=LoopConfig)  # the loop

    @property
    def rows_per_pass(self) -> int:  # sequences one rank's pass takes: a dp rank's micro-batch
        p, t = self.parallel, self.train
        return t.batch_size // max(1, p.dp * p.microbatches * t.accumulation)


SECTIONS: dict[str, type] = typing.get_type_hints(TrainConfig)
# Fields that change how often a run reports or how long it goes, not what it computes.
CADENCE = ("train.steps", "train.eval_every", "train.eval_batches", "train.log_every",
           "train.checkpoint_every")


def _valid_name(section: str, key: str | None, where: str) -> None:
    if section not in SECTIONS:
        raise ValueError(f"unknown section [{section}] in {where}; valid sections: "
                         f"{', '.join(SECTIONS)}")
    names = [f.name for f in fields(SECTIONS[section])]
    if key is not None and key not in names:
        raise ValueError(f"unknown key {section}.{key} in {where}; valid keys of [{section}]: "
                         f"{', '.join(names)}")


def _typed(name: str, hint: object, value: object, where: str) -> object:
    """The value as the field's type (a whole number is a float where a float is due), or
    one line naming the field."""
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    allowed = typing.get_args(hint) or (hint,)  # str | None -> (str, NoneType)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        kind = {int: "a whole number", float: "a number", str: "a string",
                bool: "true or false"}[allowed[0]]
        raise ValueError(f"{name} in {where} must be {kind}; got {value!r}")
    return value


def from_dict(d: dict, where: str = "the config") -> TrainConfig:
    """A TrainConfig from {section: {key: value}}; missing keys keep their defaults,
    unknown ones and wrong types are one line naming them."""
    sections = {}
    for section, table in d.items():
        _valid_name(section, None, where)
        if not isinstance(table, dict):
            raise ValueError(f"[{section}] in {where} must be a table of keys; got {table!r}")
        hints = typing.get_type_hints(SECTIONS[section])
        values = {}
        for key, value in table.items():
            _valid_name(section, key, where)
            values[key] = _typed(f"{section}.{key}", hints[key], value, where)
        sections[section] = SECTIONS[section](**values)
    return TrainConfig(**sections)


def to_dict(config: TrainConfig) -> dict:
    """{section: {key: value}}, the inverse of from_dict."""
    return asdict(config)


def _read_toml(name_or_path: str) -> tuple[dict, str]:
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = PRESETS / f"{name_or_path}.toml"
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.toml")))
        raise ValueError(f"config must be a preset ({presets}) or a .toml file that exists; "
                         f"got {name_or_path!r}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")), path.name
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
                         f"position {err.start}); TOML files are UTF-8: save it as UTF-8"
                         ) from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from None


def load_config(name_or_path: str = "tiny", overrides: dict | None = None) -> TrainConfig:
    """A preset's name ("tiny", "small") or a .toml file, with `overrides` by dotted name
    ({"parallel.dp": 2}) on top. Not yet checked against the ranks: see `check`."""
    d, where = _read_toml(name_or_path)
    for dotted, value in (overrides or {}).items():
        section, dot, key = dotted.partition(".")
        if not dot:
            raise ValueError(f"overrides are named section.key (e.g. 'parallel.dp'); got "
                             f"{dotted!r}")
        _valid_name(section, key, "overrides")
        table = d.setdefault(section, {})
        if isinstance(table, dict):  # a section that is not a table: from_dict says so
            table[key] = value
    return from_dict(d, where)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)  # shortest text that reads back as the same float
    if isinstance(value, float):
        return ("-" if value < 0 else "") + ("nan" if math.isnan(value) else "inf")
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are valid in TOML's basic strings
    return str(value)


def to_toml(config: TrainConfig) -> str:
    """The config as TOML that load_config reads back equal (None values left out)."""
    lines = []
    for section, table in to_dict(config).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(v)}" for key, v in table.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def same_run(a: TrainConfig, b: TrainConfig, ignore: Iterable[str] = CADENCE) -> list[str]:
    """The dotted names of the fields where a and b make different runs (empty: the same
    run). Steps and the eval/log cadence are ignored, so a run may be extended; note that
    more steps also stretch the cosine decay."""
    flat_a, flat_b = ({f"{s}.{k}": v for s, table in to_dict(c).items() for k, v in table.items()}
                      for c in (a, b))
    return [name for name in flat_a if name not in ignore and flat_a[name] != flat_b[name]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _near_multiples(value: int, step: int) -> str:
    below = value // step * step
    return " or ".join(str(m) for m in (below, below + step) if m > 0)


def _at_least(name: str, value: float, low: float) -> None:
    if not value >= low:
        raise ValueError(f"{name} must be >= {low}; got {value}")


def check(config: TrainConfig, world_size: int | None = None) -> None:
    """One line naming the parameter and what would work, for a configuration that cannot
    run (on `world_size` ranks, when given)."""
    m, p, o, t = config.model, config.parallel, config.optim, config.train
    try:
        m.check()
    except ValueError as err:  # DecoderConfig's lines start with the field's name
        raise ValueError(f"model.{err}") from None
    for name in ("dp", "pp", "tp", "cp", "ep", "dp_replicate", "microbatches", "virtual"):
        _at_least(f"parallel.{name}", getattr(p, name), 1)
    if p.ep > 1 and not m.experts:
        raise ValueError(f"parallel.ep={p.ep} splits experts, but model.experts = 0; set "
                         "model.experts (e.g. 4) or ep = 1")
    if p.dp % p.ep or m.experts % p.ep:
        raise ValueError(f"parallel.ep={p.ep} must divide parallel.dp={p.dp} (ep lives inside "
                         f"data parallelism) and model.experts={m.experts}; ep in "
                         f"{_divisors(math.gcd(p.dp, m.experts))} would work")
    if p.zero not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero must be 0 (plain DDP), 1, 2 or 3; got {p.zero}")
    if p.dp_replicate > 1 and (p.dp % p.dp_replicate or not p.zero or p.ep > 1):
        raise ValueError(f"parallel.dp_replicate={p.dp_replicate} (HSDP) needs ZeRO (zero 1, 2 "
                         f"or 3) to shard inside each group, ep = 1, and a divisor of "
                         f"dp={p.dp}: dp_replicate in {_divisors(p.dp)}")
    for name, value, allowed in (
        ("parallel.schedule", p.schedule, SCHEDULES), ("parallel.cp_kind", p.cp_kind, CP_CORES),
        ("train.precision", t.precision, PRECISIONS), ("train.recompute", t.recompute, RECOMPUTE)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    ranks = p.dp * p.pp * p.tp * p.cp
    if world_size is not None and ranks != world_size:
        raise ValueError(f"dp x pp x tp x cp = {p.dp} x {p.pp} x {p.tp} x {p.cp} = {ranks} "
                         f"ranks, but there are {world_size}; choose degrees whose product is "
                         f"{world_size}")
    if m.heads % p.tp or m.kv_heads % p.tp or m.ffn % p.tp or m.vocab_size % p.tp:
        fits = _divisors(math.gcd(m.heads, m.kv_heads, m.ffn, m.vocab_size))
        raise ValueError(f"parallel.tp={p.tp} must divide heads={m.heads}, kv_heads={m.kv_heads}, "
                         f"the SwiGLU width {m.ffn} and vocab={m.vocab_size}; tp in {fits} works")
    if p.cp > 1 and p.cp_kind == "ulysses":  # each tp rank's heads, over cp
        check_heads(m.heads // p.tp, m.kv_heads // p.tp, p.cp, f"parallel.cp with tp={p.tp}: ")
    stages = p.pp * p.virtual
    if stages > m.layers:
        name, value = ("pp", f"={p.pp}") if p.virtual == 1 else ("pp x virtual", f" = {p.pp} x "
                                                                 f"{p.virtual} = {stages}")
        raise ValueError(f"parallel.{name}{value} pipeline stages exceeds model.layers="
                         f"{m.layers}; each stage needs a layer: {name} <= {m.layers}")
    if p.virtual > 1 and m.layers % stages:
        fits = [v for v in _divisors(m.layers) if m.layers % (p.pp * v) == 0]
        raise ValueError(f"model.layers={m.layers} must split evenly over pp x virtual = {p.pp} x "
                         f"{p.virtual} = {stages} stages; layers a multiple of {stages}, or "
                         f"virtual in {fits}")
    try:
        SCHEDULES[p.schedule].check(p.pp, p.microbatches, p.virtual)
    except ValueError as err:
        raise ValueError(f"parallel.schedule={p.schedule!r} with pp={p.pp}: {err}") from None
    if p.sequence_parallel and p.tp == 1:
        raise ValueError("parallel.sequence_parallel needs tp > 1 (it splits what tensor "
                         "parallelism keeps whole); set tp >= 2 or sequence_parallel = false")
    if p.cp > 1 and m.seq_len % (2 * p.cp):
        raise ValueError(f"model.seq_len={m.seq_len} must split into 2 x cp = {2 * p.cp} "
                         f"chunks (the balanced causal ring gives each rank an early and a "
                         f"late chunk); seq_len {_near_multiples(m.seq_len, 2 * p.cp)} works")
    if p.sequence_parallel and m.seq_len % (p.cp * p.tp):
        raise ValueError(f"model.seq_len={m.seq_len} must split over cp x tp = {p.cp * p.tp} "
                         f"ranks for sequence parallelism; seq_len "
                         f"{_near_multiples(m.seq_len, p.cp * p.tp)} works")
    for name in ("batch_size", "accumulation", "steps", "eval_batches", "log_every"):
        _at_least(f"train.{name}", getattr(t, name), 1)
    _at_least("train.eval_every", t.eval_every, 0)
    _at_least("train.checkpoint_every", t.checkpoint_every, 0)
    split = p.dp * p.microbatches * t.accumulation
    if t.batch_size % split:
        raise ValueError(f"train.batch_size={t.batch_size} must split into dp x microbatches "
                         f"x accumulation = {p.dp} x {p.microbatches} x {t.accumulation} = "
                         f"{split}: a multiple of {split}, e.g. "
                         f"{_near_multiples(t.batch_size, split)}")
    if not o.lr > 0:
        raise ValueError(f"optim.lr must be > 0; got {o.lr}")
    if not 0 <= o.min_lr <= o.lr:
        raise ValueError(f"optim.min_lr must be between 0 and lr={o.lr}; got {o.min_lr}")
    if not 0 <= o.warmup_steps <= t.steps:
        raise ValueError(f"optim.warmup_steps must be between 0 and train.steps={t.steps}; "
                         f"got {o.warmup_steps}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise ValueError(f"optim.{name} must be in [0, 1); got {getattr(o, name)}")
    if not o.eps > 0:
        raise ValueError(f"optim.eps must be > 0; got {o.eps}")
    _at_least("optim.weight_decay", o.weight_decay, 0)
    _at_least("optim.grad_clip", o.grad_clip, 0)
    if not 0 < config.data.val_fraction < 1:
        raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive); got "
                         f"{config.data.val_fraction}")


def describe(config: TrainConfig) -> str:
    """A few lines a learner reads at the start of a run: model, mesh, numerics, batch."""
    m, p, o, t = config.model, config.parallel, config.optim, config.train
    mesh = f"dp {p.dp} x pp {p.pp} x tp {p.tp} x cp {p.cp} = {p.dp * p.pp * p.tp * p.cp} rank(s)"
    mesh += (f", ZeRO-{p.zero}" if p.zero else "" if p.dp == 1 else ", DDP buckets")
    if p.dp_replicate > 1:
        mesh += (f" in groups of {p.dp // p.dp_replicate}, replicated {p.dp_replicate} "
                 "times (HSDP)")
    if p.pp > 1:
        mesh += f", schedule {p.schedule} with {p.microbatches} micro-batch"
        mesh += "es" if p.microbatches > 1 else ""
        mesh += f" and {p.virtual} stages per rank" if p.virtual > 1 else ""
    mesh += ", sequence parallel" if p.sequence_parallel else ""
    mesh += f", experts over ep={p.ep} inside dp" if p.ep > 1 else ""
    return "\n".join([
        f"model      {m.layers} layers, hidden {m.hidden}, {m.heads} heads ({m.kv_heads} "
        f"key/value), "
        f"{f'{m.experts} experts of width {m.ffn} (top-{m.top_k})' if m.experts else 'SwiGLU'}"
        f"{'' if m.experts else f' {m.ffn}'}, vocab {m.vocab_size}, "
        f"{'tied' if m.tied else 'untied'} head",
        f"mesh       {mesh}",
        f"numerics   {t.precision}, recompute {t.recompute}",
        f"batch      {t.batch_size} sequences x {m.seq_len} tokens = "
        f"{t.batch_size * m.seq_len:,} tokens per step ({config.rows_per_pass} sequences per "
        f"micro-batch per dp rank, {t.accumulation} accumulation step(s))",
        f"schedule   {t.steps} steps, lr {o.lr:g} after {o.warmup_steps} warmup steps, cosine "
        f"to {o.min_lr:g}",
        f"data       {config.data.path or 'the Python standard library sources'}",
        f"weights    {f'from {t.init_from}' if t.init_from else f'drawn from seed {t.seed}'}",
    ])
