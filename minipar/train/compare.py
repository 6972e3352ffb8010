"""Loss-curve parity as a method (what torchtitan's loss_compare.py and Megatron's golden
values do): train several configurations from the same initial weights on the same global
batches, and hold every step's loss to the same run on one process.

Each configuration is one string of space-separated `key=value` overrides: a [parallel]
key by its bare name (`dp=2 zero=1`) or any field by its dotted name
(`train.recompute=full`), on top of the shared config and flags. The trainer makes the
comparison fair: the weights come from train.seed and each step's global batch from
data.seed and the step, for any dp.

The tolerance says how far a correct composition may drift from one process:
- fp64: 1e-10. Reordered sums differ by ~1e-16 relative per operation (dp=2 and ZeRO-1
  on the tiny preset: 2e-15 over 10 steps), while any real mistake is orders above it.
- fp32: 1e-4. float32 rounds at 6e-8 relative, so a reordered all-reduce moves each
  step's gradients by ~1e-7 relative, and Adam's normalized updates carry that into
  later steps; measured on the tiny preset over 300 steps, dp=2, ZeRO-1 and
  accumulation 2 stay within 1e-6 of one process, a hundred times under the bound,
  while the mistakes parity exists to catch (a missing average over dp, a wrong shard,
  another seed, a learning rate 3% off) move the loss by 1e-2 within ten steps.
- bf16 and fp16: measured, since 8- and 11-bit mantissas make any fixed number a guess.
  The one-process reference is trained a second time with another train.accumulation:
  the same mathematics summed in another order (chunks of the batch, then their sum).
  Their largest gap is the honest size of reordering noise on this model for these
  steps; a composition reorders its sums in its own way, so it is held to MEASURED_FACTOR
  times that gap (never less than fp32's bound).

A configuration in another precision (`train.precision=fp8` against a bf16 reference:
"how large a gap is normal?") cannot match to rounding: it changes the arithmetic
itself. It is held instead to the spread of training: the reference trained again from
other initial weights (train.seed + 1), whose largest gap to the reference is how far two
equally good runs drift apart. A precision within it is as good as another seed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..cli import OneLineParser, output_folder, run_command
from ..plots import to_png
from ..report import format_table, progress
from ..runtime import DEFAULT_TIMEOUT, launch
from .config import ParallelConfig, TrainConfig, check, load_config
from .curves import render_curves
from .flags import add_flags, add_launch_flags, overrides_from_args
from .loop import Run, refuse_unbuilt, train

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PARALLEL_KEYS = tuple(f.name for f in fields(ParallelConfig))
FIXED_TOLERANCES = {"fp64": 1e-10, "fp32": 1e-4}
MEASURED_FACTOR = 4  # a composition's reordering vs the measured one: the same kind of noise
REFERENCE = "one process"


@dataclass(frozen=True)
class Gap:
    """The largest |loss - reference loss| over the steps, and the (1-based) step of it."""

    largest: float
    step: int


@dataclass(frozen=True)
class Tolerance:
    """The largest gap a correct composition may show, and why that number."""

    bound: float
    why: str


def one_process(config: TrainConfig) -> TrainConfig:
    """The same run on one process: every degree 1, ZeRO off, the same global batch (and
    the same model: a mixture of experts keeps its experts, all on the one rank)."""
    return replace(config, parallel=replace(config.parallel, dp=1, pp=1, tp=1, cp=1, ep=1,
                                            zero=0, sequence_parallel=False))


def ranks_of(config: TrainConfig) -> int:
    """The ranks a configuration spawns: dp x pp x tp x cp."""
    par = config.parallel
    return par.dp * par.pp * par.tp * par.cp


def first_with_losses(runs: Sequence[Run]) -> Run:
    """The first rank's Run that holds losses (today every rank's Run holds the batch's
    loss, all-reduced; this keeps the comparison right if a rank ever reports none)."""
    for run in runs:
        if run.losses:
            return run
    raise RuntimeError(f"none of the {len(runs)} ranks returned a loss")


def compare_losses(losses: Sequence[float], reference: Sequence[float]) -> Gap:
    """The largest gap between two loss curves of the same steps (a NaN is an infinite
    gap)."""
    if len(losses) != len(reference) or not reference:
        raise ValueError(f"loss curves must have the same number of steps (at least one); "
                         f"got {len(losses)} and {len(reference)}")
    gaps = [abs(a - b) if math.isfinite(a - b) else math.inf
            for a, b in zip(losses, reference, strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return Gap(gaps[worst], worst + 1)


def parse_overrides(text: str) -> dict[str, object]:
    """{dotted name: value} from "dp=2 zero=1 train.recompute=full"; values read as TOML
    (2, 1e-3, true, "x"), a bare word as a string."""
    overrides: dict[str, object] = {}
    if not text.split():
        raise ValueError(f"configuration {text!r} is empty; write key=value overrides, e.g. "
                         "'dp=2 zero=1'")
    for token in text.split():
        key, eq, raw = token.partition("=")
        if not (eq and key and raw):
            raise ValueError(f"configuration {text!r}: {token!r} is not key=value (e.g. dp=2 "
                             "or train.recompute=full)")
        if "." not in key and key not in PARALLEL_KEYS:
            raise ValueError(f"configuration {text!r}: {key!r} is neither a [parallel] key "
                             f"({', '.join(PARALLEL_KEYS)}) nor a dotted name such as "
                             "train.recompute")
        dotted = key if "." in key else f"parallel.{key}"
        if dotted.startswith("model."):
            # every configuration is held to the one-process run of the shared config: a
            # configuration with another model would differ by construction
            raise ValueError(f"configuration {text!r}: {dotted} changes the model, but every "
                             "configuration is compared with one process running the shared "
                             f"config; give it as a shared flag (e.g. --{key[6:].replace('_', '-')}"
                             " 4) or in the --config file")
        if dotted in overrides:
            raise ValueError(f"configuration {text!r} sets {dotted} twice")
        try:
            overrides[dotted] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[dotted] = raw
    return overrides


def configurations(config: str, shared: dict, texts: Sequence[str]
                   ) -> list[tuple[str, TrainConfig]]:
    """(label, config) for each text, checked for its ranks and for what the trainer
    composes so far: one line naming the configuration for the first that cannot run."""
    if not texts:
        raise ValueError("name at least one configuration, e.g. \"dp=2\" \"dp=2 zero=1\"")
    found = []
    for text in texts:
        overrides = parse_overrides(text)
        try:
            variant = load_config(config, {**shared, **overrides})
            check(variant, ranks_of(variant))
            refuse_unbuilt(variant)
        except ValueError as err:
            raise ValueError(f"configuration {text!r}: {err}") from None
        found.append((" ".join(text.split()), variant))
    return found


def _reordered(config: TrainConfig) -> TrainConfig:
    """The one-process run with another train.accumulation (the same sums in another
    order): 2x, else half, else any that splits the batch."""
    acc, batch = config.train.accumulation, config.train.batch_size
    for other in (2 * acc, acc // 2, *range(1, batch + 1)):
        candidate = replace(config, train=replace(config.train, accumulation=other))
        try:
            check(candidate, 1)
        except ValueError:
            continue
        if other != acc:
            return candidate
    raise ValueError(f"train.batch_size={batch} admits no second accumulation to measure "
                     f"{config.train.precision}'s tolerance; use a batch_size >= 2")


def tolerance(reference: TrainConfig, losses: Sequence[float],
              run: Callable[[TrainConfig], Run]) -> Tolerance:
    """The bound for the reference's precision (the module docstring says why); bf16 and
    fp16 train `reference` again with another accumulation through `run`."""
    precision = reference.train.precision
    if precision in FIXED_TOLERANCES:
        bound = FIXED_TOLERANCES[precision]
        return Tolerance(bound, f"{precision}'s fixed bound {bound:.0e}")
    other = _reordered(reference)
    progress(f"{REFERENCE}, accumulation {other.train.accumulation} (for {precision}'s "
             "tolerance)")
    spread = compare_losses(run(other).losses, losses).largest
    bound = max(MEASURED_FACTOR * spread, FIXED_TOLERANCES["fp32"])
    return Tolerance(bound, f"{MEASURED_FACTOR} x {spread:.1e}, the largest gap between one "
                            f"process with accumulation {reference.train.accumulation} and "
                            f"with {other.train.accumulation}: the same sums in another order")


def seed_spread(reference: TrainConfig, losses: Sequence[float],
                run: Callable[[TrainConfig], Run]) -> Tolerance:
    """The bound for a configuration in another precision: the largest gap between the
    reference and the reference from other initial weights (module docstring)."""
    other = replace(reference, train=replace(reference.train, seed=reference.train.seed + 1))
    progress(f"{REFERENCE}, train.seed {other.train.seed} (the spread of training, for "
             "configurations in another precision)")
    spread = compare_losses(run(other).losses, losses)
    return Tolerance(spread.largest, f"{spread.largest:.1e}, the largest gap between one "
                                     f"process from train.seed {reference.train.seed} and "
                                     f"from {other.train.seed}")


def run_config(config: TrainConfig, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT,
               device: str = "auto") -> Run:
    """Train `config` on fresh ranks (dp x pp x tp x cp of them); the Run holding losses."""
    return first_with_losses(launch(train, ranks_of(config), config, None, backend=backend,
                                    device=device, timeout=timeout))


def against_one_process(losses: Sequence[float], config: TrainConfig,
                        run: Callable[[TrainConfig], Run]) -> tuple[Run, Tolerance, Gap]:
    """The reference run of `config` on one process, the tolerance, and the gap of
    `losses` to it (what `minipar train --check` reports)."""
    progress(REFERENCE)
    reference = one_process(config)
    ref = run(reference)
    return ref, tolerance(reference, ref.losses, run), compare_losses(losses, ref.losses)


def compare(base: TrainConfig, variants: Sequence[tuple[str, TrainConfig]],
            run: Callable[[TrainConfig], Run]) -> dict:
    """Run the one-process reference and every variant; each variant's gap and verdict."""
    progress(REFERENCE)
    reference = one_process(base)
    ref = run(reference)
    bound = tolerance(reference, ref.losses, run)
    precision = reference.train.precision
    spread = (seed_spread(reference, ref.losses, run)
              if any(c.train.precision != precision for _, c in variants) else None)
    rows = [{"config": REFERENCE, "ranks": 1, "final_loss": ref.losses[-1],
             "records": ref.records}]
    for label, config in variants:
        progress(f"{label} ({ranks_of(config)} rank(s))")
        mine = run(config)
        gap = compare_losses(mine.losses, ref.losses)
        other = config.train.precision != precision  # held to the seeds' spread
        rows.append({"config": label, "ranks": ranks_of(config), "final_loss": mine.losses[-1],
                     "largest_gap": gap.largest, "at_step": gap.step, "other_precision": other,
                     "matches": gap.largest <= (spread if other else bound).bound,
                     "records": mine.records})
    result = {"precision": precision, "steps": reference.train.steps,
              "tolerance": bound.bound, "tolerance_why": bound.why, "rows": rows}
    if spread is not None:
        result.update(seed_spread=spread.bound, seed_spread_why=spread.why)
    return result


def report(result: dict) -> str:
    """The table: config, ranks, final loss, largest gap, its step, the verdict."""
    shown = [{"config": r["config"], "ranks": r["ranks"], "final": f"{r['final_loss']:.6f}",
              "gap": f"{r['largest_gap']:.1e}" if "largest_gap" in r else "-",
              "step": r.get("at_step", "-"),
              "verdict": "reference" if "matches" not in r
              else ("within the seeds' spread" if r["matches"] else "OUTSIDE the seeds' spread")
              if r.get("other_precision") else "matches" if r["matches"] else "DIFFERS"}
             for r in result["rows"]]
    table = format_table(shown, [("config", "config"), ("ranks", "ranks"),
                                 ("final", "final loss"), ("gap", "largest |gap|"),
                                 ("step", "at step"), ("verdict", "verdict")])
    table = "\n".join(line.rstrip() for line in table.splitlines())
    differ = [r["config"] for r in result["rows"] if r.get("matches") is False]
    # a row in another precision is judged by the seeds' spread: "within", not "match"
    held = "are within their bounds" if "seed_spread" in result else "match one process"
    verdict = (f"{len(differ)} of {len(result['rows']) - 1} configuration(s) differ from "
               f"one process: {', '.join(differ)}" if differ else
               f"all {len(result['rows']) - 1} configuration(s) {held}")
    spread = (f"\nanother precision is held to the spread of training: "
              f"{result['seed_spread']:.1e} ({result['seed_spread_why']})"
              if "seed_spread" in result else "")
    return (f"{result['precision']}, {result['steps']} steps, every step's loss vs "
            f"{REFERENCE}; tolerance {result['tolerance']:.1e} ({result['tolerance_why']})"
            f"{spread}\n{table}\n{verdict}")


def save(result: dict, out: Path) -> None:
    """compare.json (every step's loss of every configuration) and compare.png (the
    curves overlaid)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{**{k: v for k, v in r.items() if k != "records"},
             "losses": [rec["loss"] for rec in r["records"]]} for r in result["rows"]]
    (out / "compare.json").write_text(json.dumps({**result, "rows": rows}, indent=1))
    fig = render_curves({r["config"]: r["records"] for r in result["rows"]}, overlay=True,
                        title=f"loss curves vs one process ({result['precision']})")
    (out / "compare.png").write_bytes(to_png(fig))


def parser(prog: str) -> OneLineParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("configurations", nargs="*", metavar="CONFIGURATION",
                   help="space-separated key=value overrides, one run each: a [parallel] key "
                        "(dp=2 zero=1) or a dotted name (train.recompute=full)")
    add_flags(p)
    p.add_argument("--out", type=output_folder, default="runs/compare",
                   help="folder for compare.json and compare.png (default: runs/compare)")
    add_launch_flags(p)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m minipar.train compare") -> int:
    """`minipar train compare`: exit 0 if every configuration matches one process, 1 if
    any does not, 2 for bad input."""
    args = parser(prog).parse_intermixed_args(argv)

    def body() -> int:
        shared = overrides_from_args(args)
        base = load_config(args.config, shared)
        check(one_process(base), 1)
        variants = configurations(args.config, shared, args.configurations)
        result = compare(base, variants,
                         lambda c: run_config(c, backend=args.backend, device=args.device,
                                              timeout=args.timeout))
        save(result, Path(args.out))
        print(report(result))
        print(f"wrote {Path(args.out) / 'compare.png'} and compare.json")
        return 0 if all(r.get("matches", True) for r in result["rows"]) else 1

    return run_command(prog, body)
