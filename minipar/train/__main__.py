"""Train the trainer's decoder on real text: the Python standard library's own sources by
default (no download), or any file or folder (--data). A preset (--config tiny, about a
minute on 2 cores; small, about ten) with flags on top; every impossible combination is
one line. Writes config.toml and metrics.jsonl (loss, lr, grad_norm, tokens_per_s, mfu,
val_loss) into --out, and sharded checkpoints (--checkpoint-every N, and at the end);
--resume continues from the latest on any mesh, --stop-after N stops as if interrupted;
under torchrun --max-restarts, restarted workers resume on their own. --fault
KIND@RANK:STEP rehearses a failure (kill, raise, hang, disk-full; faults.py).
--check trains the same config again on one process and compares
the loss curves with compare.py's comparison (to 1e-10 in fp64, 1e-4 in fp32, a measured
bound in bf16 and fp16). Runs on the CPU processes it spawns (dp x pp x tp x cp of them,
or --ranks), or under torchrun. Examples: --config tiny --steps 200; --dp 2 --zero 1
--precision fp64 --check. --dry-run --ranks 1024 checks a large config's layout on no
hardware: each rank's groups, parameters and memory by kind, in seconds.

Subcommands: `compare --precision fp64 "dp=2" "dp=2 zero=1"` trains each configuration
(space-separated key=value overrides) and the one-process reference, prints a table of
every step's largest loss gap, writes compare.json and compare.png, and exits 1 if any
configuration does not match; `export RUN --to FILE` writes the run's latest checkpoint
as one plain state_dict (and its config as JSON); `sample RUN_OR_FILE --prompt "def "`
writes text with the run's weights."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from ..cli import OneLineParser, output_folder, positive_int, run_command
from ..runtime import launch, resolve_backend, resolve_device, under_torchrun
from ..runtime.torchrun import elastic_attempt
from .compare import against_one_process, first_with_losses, one_process, run_config
from .compare import main as compare_main
from .config import check, load_config, same_run
from .data import check_corpus
from .dry_run import dry_run
from .export import export_main, sample_main
from .faults import FAULT_KINDS, Fault
from .flags import add_flags, add_launch_flags, fit_warmup, overrides_from_args
from .hf_format import fit_model, model_fields
from .loop import refuse_unbuilt, train
from .sharded_checkpoint import verify_checkpoint


def parser(prog: str = "python -m minipar.train") -> OneLineParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "),
                      epilog=f"{prog} compare --help: configurations' loss curves against "
                             "one process, step by step")
    add_flags(p)
    p.add_argument("--ranks", type=positive_int, default=None,
                   help="ranks to spawn; dp becomes ranks / (pp x tp x cp) unless --dp is "
                        "given (default: the product of the degrees)")
    p.add_argument("--out", type=output_folder, default="runs/latest",
                   help="run folder for config.toml and metrics.jsonl (default: runs/latest)")
    p.add_argument("--force", action="store_true",
                   help="reuse an --out folder that holds a run of another config")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest complete checkpoint, on "
                        "this mesh (the checkpoint reshards onto it)")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="STEP",
                   help="stop after this step as if interrupted (its checkpoint is saved); "
                        "--resume continues")
    p.add_argument("--fault", type=_fault, default=None, metavar="KIND@RANK:STEP",
                   help=f"make one rank fail at one step, to rehearse it ({', '.join(FAULT_KINDS)}"
                        "; e.g. kill@1:5); only a torchrun job's first attempt fails")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and build every stage's layout on the meta device "
                        "over a fake process group (any --ranks, nothing computed): print each "
                        "rank's groups, parameters and memory by kind")
    p.add_argument("--check", action="store_true",
                   help="also train on one process and compare the loss curves")
    p.add_argument("--allocator-snapshot", action="store_true",
                   help="on a GPU: record every allocation into OUT/allocator_rank<r>.pickle "
                        "(drop it on https://pytorch.org/memory_viz)")
    add_launch_flags(p)
    return p


def _fault(text: str) -> Fault:
    try:
        return Fault.parse(text)
    except ValueError as err:  # argparse prints an ArgumentTypeError's message as it is
        raise argparse.ArgumentTypeError(str(err).removeprefix("--fault ")) from None


def restarted_by_torchrun() -> bool:
    """A worker torchrun started again after a failure (--max-restarts), on any node: it
    resumes from the latest complete checkpoint in --out, as the job it replaces would."""
    return under_torchrun() and elastic_attempt() > 0


def _config(args):
    overrides = overrides_from_args(args)
    config, note = fit_warmup(load_config(args.config, overrides), args.config, overrides)
    if note and os.environ.get("RANK", "0") == "0":  # under torchrun, one line, not one per rank
        print(note)
    if config.train.init_from:  # the model's shape is the checkpoint's
        fields = model_fields(config.train.init_from)
        clash = [k for k, v in fields.items() if overrides.get(f"model.{k}", v) != v]
        if clash:
            raise ValueError(f"model.{clash[0]}={overrides[f'model.{clash[0]}']!r} was given, but "
                             f"the checkpoint in --init-from has {fields[clash[0]]!r}; leave "
                             "it out: the model's shape comes from the checkpoint")
        config = fit_model(config, fields)
    par = config.parallel
    others = par.pp * par.tp * par.cp
    # under torchrun the group is not joined yet: its size is in the environment
    ranks = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.ranks
    if ranks is not None and "parallel.dp" not in overrides:
        if ranks % others:
            given = "torchrun's WORLD_SIZE" if under_torchrun() else "--ranks"
            raise ValueError(f"{given} {ranks} is not a multiple of pp x tp x cp = {others}; "
                             f"use --ranks {others * max(1, ranks // others)} or other degrees")
        config = replace(config, parallel=replace(par, dp=ranks // others))
    ranks = config.parallel.dp * others
    check(config, ranks)
    refuse_unbuilt(config)  # one line here, not a traceback from every rank
    if under_torchrun() and ranks != int(os.environ["WORLD_SIZE"]):
        size, par = int(os.environ["WORLD_SIZE"]), config.parallel
        raise ValueError(f"torchrun started {size} processes but dp {par.dp} x pp {par.pp} x "
                         f"tp {par.tp} x cp {par.cp} = {ranks}; start torchrun with {ranks} in "
                         "all (nnodes x nproc-per-node), or leave out --dp to derive it")
    fault = args.fault
    if fault and (fault.rank >= ranks or fault.step > config.train.steps):
        raise ValueError(f"--fault {fault.kind}@{fault.rank}:{fault.step} would never fire: "
                         f"the run has ranks 0..{ranks - 1} and steps 1..{config.train.steps}")
    if args.dry_run:  # the layout only: no corpus read, no rank started
        return config, ranks
    data = config.data
    check_corpus(data.path, data.val_fraction, data.seed, config.model.seq_len)
    if args.check:  # the reference too, before the run rather than after it
        check(one_process(config), 1)
    return config, ranks


def _refuse_other_run(config, out: Path, force: bool, resume: bool) -> None:
    """--out holding another run is refused, unless --force; --resume may change the mesh
    (the checkpoint reshards onto it) and nothing else."""
    saved = out / "config.toml"
    if force and resume:
        raise ValueError("--force starts the run in --out again and --resume continues it; "
                         "pass one of them")
    if not saved.exists() or force:
        return
    differ = same_run(load_config(str(saved)), config)
    if resume:
        differ = [name for name in differ if not name.startswith("parallel.")]
    if differ:
        how = ("--resume continues it with the same config on any mesh (only [parallel] may "
               "change)" if resume else "pick another --out, --resume it, or pass --force to "
               "overwrite it")
        raise ValueError(f"--out {out} holds a run of another config ({', '.join(differ[:4])} "
                         f"differ); {how}")


def main(argv: list[str] | None = None, prog: str = "python -m minipar.train") -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the subcommands; everything else is the trainer's flags
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:], prog=f"{prog} compare")
    if argv[:1] == ["export"]:
        return export_main(argv[1:], prog=f"{prog} export")
    if argv[:1] == ["sample"]:
        return sample_main(argv[1:], prog=f"{prog} sample")
    args = parser(prog).parse_args(argv)

    def body() -> int:
        config, ranks = _config(args)
        out = Path(args.out)
        if args.dry_run:
            if args.check or args.resume or args.fault:
                raise ValueError("--dry-run builds the layout and trains nothing: leave out "
                                 "--check, --resume and --fault")
            # every rank's line goes to a file only where asked: never beside a real run
            asked = any(a == "--out" or a.startswith("--out=") for a in argv)
            print(dry_run(config, ranks, out if asked else None))
            return 0
        # a restarted torchrun worker continues the job: never --force it away
        resume, force = (True, False) if restarted_by_torchrun() else (args.resume, args.force)
        _refuse_other_run(config, out, force, resume)
        if resume:
            verify_checkpoint(out, config)  # a damaged checkpoint: one line, before any rank
        if force and (out / "checkpoints").exists():
            # a new run: the old one's checkpoints go (under torchrun every process tries)
            shutil.rmtree(out / "checkpoints", ignore_errors=under_torchrun())
        if args.allocator_snapshot and resolve_device(
                args.device, resolve_backend(args.backend, ranks)) != "cuda":
            raise ValueError("--allocator-snapshot records CUDA's allocator, and these ranks "
                             "compute on the CPU; leave it out here, or pass --device cuda")
        runs = launch(train, ranks, config, out, False, resume, args.stop_after, args.fault,
                      args.allocator_snapshot, backend=args.backend, device=args.device,
                      timeout=args.timeout)
        if not args.check:
            return 0
        one, bound, gap = against_one_process(
            first_with_losses(runs).losses, config,
            lambda c: run_config(c, backend=args.backend, device=args.device,
                                 timeout=args.timeout))
        same = gap.largest <= bound.bound
        print(f"loss curve {'matches' if same else 'does NOT match'} one process: largest "
              f"gap {gap.largest:.1e} at step {gap.step} of {len(one.losses)}; tolerance "
              f"{bound.bound:.1e} ({bound.why})")
        return 0 if same else 1

    return run_command(prog, body)


if __name__ == "__main__":
    sys.exit(main())
