"""The training loop, top to bottom (run on every rank): build the model from its seed,
draw each step's global batch, accumulate, reduce, clip by the global norm, step, log.

One step, as every rank runs it:
1. the learning rate for this step (warmup, then cosine);
2. this rank's rows of the step's global batch (the sampler: the same global batch for
   any dp), cut into `accumulation` chunks; each chunk's mean loss is weighted by
   dp x chunk / global rows (the package's loss-scaling convention, `shard_weight`), so
   after the average over dp every token counts once, as in one process;
3. the gradients reduced as one process's: averaged over the data-parallel replicas
   inside the pipeline's backward (DDP, ZeRO-2 and ZeRO-3 in the last chunk's backward;
   ZeRO-1 after it), then the tied embedding's two copies summed (model_part.py);
4. the global gradient norm (each entry counted once) and clipping by it;
5. AdamW's update; the batch's loss, tokens per second and MFU logged.
In fp16 the loss is scaled before backward and the gradients unscaled after the
reduction; an overflow on any rank skips the step on every rank (precision.py).

`train` is that step in a loop, with small named pieces around it: the log
(`_open_log`, `_log`), the traced step and a rehearsed failure (`_watched`), the
record with tokens per second and MFU (`_Meter`), when to evaluate (`_evaluates`) and
when to save (`_checkpoints`), and the memory step after the last.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives, trace
from ..mesh.model import tied_ends_on_one_rank
from ..moe.moe_decoder import moe_decoder
from ..pipeline import SCHEDULES, schedule
from ..runtime import allocator_history, rank, reset_memory_peak, world_size
from ..runtime.progress import beat
from ..trace import record
from .compile_blocks import refuse_uncompilable
from .config import LoopConfig, TrainConfig, check, describe, to_toml
from .curves import save_run_pictures
from .data import BatchSampler, load_tokens
from .device_peak import Peak, run_peak
from .faults import Fault
from .hf_format import read_hf, refuse_other_shape
from .memory_report import memory_rows, save_memory
from .metrics import MetricsLog, StepClock, mfu, read_metrics
from .model_part import ModelPart
from .optim import clip_, learning_rate, squared_norm
from .precision import COMPUTE_DTYPES, PARAM_DTYPES, LossScaler
from .sharded_checkpoint import load_checkpoint, load_whole, save_checkpoint

TRACED_STEP = 3  # the step saved as step.trace.json: past the first steps' warm-up


@dataclass
class Run:
    """What a run leaves on each rank: one record per step (as in metrics.jsonl)."""

    records: list[dict] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # keep_weights=True
    memory: dict = field(default_factory=dict)  # this rank's bytes by kind (memory_report.py)
    peak: Peak | None = None  # what MFU divided by, and where it came from (device_peak.py)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        return [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r]


def refuse_unbuilt(config: TrainConfig) -> None:
    """One line for a combination the trainer does not compose (the config itself is
    valid: `check` passed)."""
    par = config.parallel
    if par.schedule in ("pipedream", "terapipe"):
        why = ("updates the weights after every micro-batch (no flush), so it is not the "
               "one-process optimizer" if par.schedule == "pipedream" else
               "cuts one sequence into token slices, which the decoder's stages do not carry")
        raise ValueError(f"parallel.schedule={par.schedule!r} {why}; the trainer runs the "
                         f"synchronous schedules: {', '.join(SYNCHRONOUS)}")
    if config.model.experts and (par.tp > 1 or par.cp > 1):
        raise ValueError(f"model.experts={config.model.experts} with tp={par.tp}, cp={par.cp}: "
                         "the trainer splits experts over ep inside dp, beside pp; tensor and "
                         "context parallelism of the expert blocks are not built: use tp = "
                         "cp = 1")
    if config.train.precision == "fp8" and config.train.recompute != "none":
        raise ValueError(f"train.precision='fp8' with train.recompute="
                         f"{config.train.recompute!r}: the recomputed forward would run its "
                         "matmuls in float32, not the FP8 that forward used; use recompute "
                         "'none' with fp8")
    refuse_uncompilable(config)
    if par.zero == 3 and par.ep > 1:
        raise ValueError("parallel.zero=3 with ep > 1 is not built: ZeRO-3 gathers whole "
                         "blocks, whose experts are replicated over fewer ranks (dp) than "
                         "their dense weights (dp x ep); use zero 0, 1 or 2 with experts")
    plan = schedule(par.schedule, par.pp, par.microbatches, par.virtual)
    if par.pp > 1 and config.model.tied and (par.zero or par.dp * par.cp > 1) and \
            plan.rank_of(0) == plan.rank_of(plan.stages - 1):
        # said before the model is built: ZeRO-3 crashed flattening the one weight twice
        raise tied_ends_on_one_rank(par.schedule)


SYNCHRONOUS = tuple(name for name in SCHEDULES if name not in ("pipedream", "terapipe"))


def _gathered(events: list) -> list:
    """Every rank's events of the traced step, on rank 0 (others get [])."""
    if world_size() == 1:
        return events
    everyone = [None] * world_size() if rank() == 0 else None
    dist.gather_object(events, everyone, dst=0)
    return [e for mine in everyone for e in mine] if rank() == 0 else []


def evaluate(part: ModelPart, sampler: BatchSampler, batches: int) -> float:
    """The validation loss: the mean over `batches` fixed global batches (steps 0.. of a
    sampler of the held-out documents, so every evaluation sees the same tokens)."""
    sampler.load_state_dict({"step": 0})
    total = 0.0
    for _ in range(batches):
        share = part.eval_loss(*sampler.next(), sampler.batch_size)
        total += share or 0.0  # None: a rank without the last stage has no loss
    return part.mean_over_ranks(total) / batches


def train_step(part: ModelPart, scaler: LossScaler, ids: torch.Tensor,
               targets: torch.Tensor, config: TrainConfig, lr: float
               ) -> tuple[float, float | None, bool]:
    """One optimizer step on this rank's rows (steps 2-5 of the module docstring): the
    batch's mean loss, the global gradient norm (None after an fp16 overflow), and
    whether the step was skipped for one."""
    # the part's first step checks that every collective's ranks agree on shapes and
    # arguments (one handshake per call: collectives.validation); each later step makes the
    # same calls, where the handshakes would only cost time, as torch's own never pay them
    with collectives.validation(not part.stepped, every_thread=True):
        outcome = _step(part, scaler, ids, targets, config, lr)
    part.stepped = True
    return outcome


def _step(part: ModelPart, scaler: LossScaler, ids: torch.Tensor, targets: torch.Tensor,
          config: TrainConfig, lr: float) -> tuple[float, float | None, bool]:
    accumulation, batch = config.train.accumulation, config.train.batch_size
    chunks = list(zip(torch.tensor_split(ids, accumulation),
                      torch.tensor_split(targets, accumulation), strict=True))
    loss_share = 0.0
    for i, (x, y) in enumerate(chunks):
        with record("compute", "forward+backward", microbatch=i):
            share = part.forward_backward(x, y, batch, scaler, last=i == len(chunks) - 1)
        loss_share += share or 0.0  # None: a rank without the last stage has no loss
    part.reduce_gradients()
    owned = part.owned_gradients()
    # this rank's check and unscale; if another rank overflowed, the step is skipped anyway
    mine = scaler.unscale_and_check(owned, groups=())
    # one all-reduce agrees on the loss, the norm and any overflow (one rank's skips all)
    loss, squares, overflow = part.agree(loss_share, squared_norm(part.norm_gradients()), mine)
    if overflow:
        norm = None  # no norm of gradients that overflowed (and JSON has no inf)
        part.skip()
    else:
        norm = math.sqrt(squares)
        clip_(owned, norm, config.optim.grad_clip)
        with record("compute", "optimizer"):
            part.update(lr)
    part.end_balance_step()  # experts: the step's loads, logged (and "bias" steps by them)
    scaler.update(overflow)
    return loss, norm, overflow


def build_part(config: TrainConfig) -> ModelPart:
    """The decoder from its seed, on this rank's part of the run's mesh (data parallelism
    alone is the mesh with pp = tp = cp = 1)."""
    model = moe_decoder(config.model, config.train.seed, PARAM_DTYPES[config.train.precision])
    return ModelPart(model, config)


def train(config: TrainConfig, out: str | Path | None = None, keep_weights: bool = False,
          resume: bool = False, stop_after: int | None = None,
          fault: Fault | None = None, allocator_snapshot: bool = False) -> Run:
    """Train `config` on this rank (every rank of the run calls it); write metrics.jsonl,
    config.toml, memory.json and sharded checkpoints (every train.checkpoint_every steps
    and at the end) into `out` and return the step records, this rank's memory by kind
    (and, with `keep_weights`, this rank's parameters under the twin's names). `resume`
    continues from the latest complete checkpoint in `out`, on any mesh; `stop_after`
    ends the run after that step as if it were stopped there (its checkpoint saved);
    `fault` makes one rank fail at one step (faults.py: rehearsing failures);
    `allocator_snapshot` (on a GPU) records every allocation into
    `out`/allocator_rank<r>.pickle, for https://pytorch.org/memory_viz."""
    if allocator_snapshot:
        if out is None:
            raise ValueError("allocator_snapshot needs the run folder (out) to write into")
        with allocator_history(Path(out) / f"allocator_rank{rank()}.pickle"):
            return train(config, out, keep_weights, resume, stop_after, fault)
    check(config, world_size())
    refuse_unbuilt(config)
    if (resume or stop_after is not None) and out is None:
        raise ValueError("resume and stop_after need the run folder (out) that holds the "
                         "checkpoints")
    loop = config.train
    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    part = build_part(config)
    # the same seed and step -> the same global batch for any dp; each replica takes its rows
    sampler = BatchSampler(tokens.train, config.model.seq_len, loop.batch_size,
                           config.data.seed, part.dp_rank, part.dp)
    held_out = BatchSampler(tokens.val, config.model.seq_len, loop.batch_size,
                            config.data.seed + 1, part.dp_rank, part.dp)
    scaler = LossScaler(enabled=loop.precision == "fp16")
    if loop.init_from:  # a Llama that transformers saved, in place of the seed's weights
        fields, state = read_hf(loop.init_from)
        refuse_other_shape(config, fields)
        load_whole(part, config, state)
    first = load_checkpoint(part, config, out, scaler) if resume else 0
    sampler.load_state_dict({"step": first})  # the batches follow the step: nothing else
    stop = loop.steps if stop_after is None else min(stop_after, loop.steps)
    # MFU against the peak of the dtype the matmuls run in, on this model's own shapes
    peak = run_peak(COMPUTE_DTYPES[loop.precision], config.model, config.rows_per_pass)
    # the allocator's peak (on a GPU) counts from here: what is held now (the model, its
    # batches' samplers) is its floor, while the peak-timing matmul's 8192^2 operands,
    # freed, are not in it (they were: the audit's finding 7)
    reset_memory_peak()
    meter = _Meter(config, peak)
    log = _open_log(config, out, resume, first, peak)
    run, events = Run(peak=peak), []
    for step in range(first, stop):
        lr = learning_rate(step, config.optim, loop.steps)
        with _watched(step, config, out, fault, events), StepClock() as clock:
            loss, norm, overflow = train_step(part, scaler, *sampler.next(), config, lr)
        beat()  # a step done: progress, for the launcher's watchdog (runtime/progress.py)
        record = meter.record(step, loss, lr, norm, clock, scaler, overflow)
        if _evaluates(step, loop):
            record["val_loss"] = evaluate(part, held_out, loop.eval_batches)
        if part.loads is not None:
            record["expert_load"] = part.loads  # per block, per expert: token choices
        run.records.append(record)
        _log(log, record, loop)
        if out is not None and _checkpoints(step, stop, loop):
            with fault.during_checkpoint(step + 1) if fault else nullcontext():
                save_checkpoint(part, config, out, step + 1, scaler)  # the end always saves
    # one untimed step after the last (Adam's state exists), no update: memory by kind
    run.memory, rows = memory_rows(part, config, *held_out.next())
    if log is not None:
        log.close()
        # the whole run's curve, the steps before a resume included
        save_run_pictures(Path(out), read_metrics(log.path), events)
        print(save_memory(Path(out), rows), flush=True)
    if keep_weights:
        run.weights = {name: p.clone() for name, p in part.full_parameters()}
    return run


# the pieces around the loop: the log, the traced step, the record, when to evaluate and save

def _open_log(config: TrainConfig, out: str | Path | None, resume: bool, first: int,
              peak: Peak) -> MetricsLog | None:
    """Rank 0's metrics.jsonl (kept up to `first` on a resume) and config.toml, and the
    run's first lines (what MFU divides by among them); None on other ranks or without
    `out`."""
    if out is None or rank() != 0:
        return None
    log = MetricsLog(Path(out) / "metrics.jsonl", keep_until=first if resume else None)
    (Path(out) / "config.toml").write_text(to_toml(config))
    print(describe(config), flush=True)
    print(peak.describe(), flush=True)
    if warning := peak.warning():  # a low precision this CPU multiplies slower than fp32
        print(warning, flush=True)
    if resume:
        print(f"resuming after step {first} of {config.train.steps}" if first else
              "resume: no complete checkpoint yet, starting at step 0", flush=True)
    return log


@contextmanager
def _watched(step: int, config: TrainConfig, out: str | Path | None, fault: Fault | None,
             events: list) -> Iterator[None]:
    """Around one step: `fault`'s failure when it is due (faults.py), and on the traced
    step (`TRACED_STEP`, with `out`) every rank's events, gathered on rank 0 into
    `events` for step.trace.json."""
    traced = out is not None and step + 1 == min(TRACED_STEP, config.train.steps)
    if traced and world_size() > 1:
        dist.barrier()  # every rank's clock starts the traced step together
    injected = fault.during_step(step + 1) if fault else nullcontext()
    with trace.capture() if traced else nullcontext() as captured, injected:
        yield
    if traced:
        events.extend(_gathered(captured.events))


class _Meter:
    """Turns a step's loss, norm and seconds into its record: tokens per second and MFU."""

    def __init__(self, config: TrainConfig, peak: Peak) -> None:
        self.steps = config.train.steps
        self.tokens = config.train.batch_size * config.model.seq_len
        self.flops, self.peak = config.model.flops_per_token(), peak

    def record(self, step: int, loss: float, lr: float, norm: float | None,
               clock: StepClock, scaler: LossScaler, overflow: bool) -> dict:
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step + 1}: the loss is {loss}; lower optim.lr "
                                     "or raise optim.warmup_steps")
        tokens_per_s = self.tokens / clock.seconds
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
                  "tokens_per_s": tokens_per_s,
                  "mfu": mfu(self.flops, tokens_per_s, self.peak.per_device,
                             self.peak.devices),
                  "seconds": clock.seconds, "cpu_seconds": clock.cpu_seconds,
                  "other_cpu_seconds": clock.other_cpu_seconds,
                  "idle_seconds": clock.idle_seconds}
        if scaler.enabled:
            record.update(loss_scale=scaler.scale, skipped=overflow)
        return record


def _evaluates(step: int, loop: LoopConfig) -> bool:
    """Every train.eval_every steps, and after the last."""
    return bool(loop.eval_every and (step + 1) % loop.eval_every == 0) or step + 1 == loop.steps


def _checkpoints(step: int, stop: int, loop: LoopConfig) -> bool:
    """Every train.checkpoint_every steps, and at the run's (or a stop_after's) end."""
    every = loop.checkpoint_every
    return step + 1 == stop or bool(every and (step + 1) % every == 0)


def _log(log: MetricsLog | None, record: dict, loop: LoopConfig) -> None:
    """The record into metrics.jsonl; a progress line every train.log_every steps, at the
    end and with each validation loss."""
    if log is None:
        return
    log.write(record)
    if record["step"] % loop.log_every == 0 or record["step"] == loop.steps \
            or "val_loss" in record:
        print(progress_line(record, loop.steps), flush=True)


def progress_line(record: dict, steps: int) -> str:
    """One line a learner watches: step, loss, rate, gradient norm, speed, MFU."""
    line = (f"step {record['step']:>5}/{steps}  loss {record['loss']:.4f}  "
            f"lr {record['lr']:.2e}  |g| {record['grad_norm'] or math.nan:.3f}  "
            f"{record['tokens_per_s']:,.0f} tok/s  MFU {record['mfu']:.1%}")
    if record["mfu"] > 1:  # never clamped: a rate above the peak means the peak is wrong
        line += "  (above 100%: the peak was timed too low; delete peak_flops.json in the " \
                "cache folder to time it again)"
    if record.get("skipped"):
        line += f"  overflow: step skipped, loss scale now {record['loss_scale']:g}"
    if "val_loss" in record:
        line += f"  val {record['val_loss']:.4f}"
    return line
