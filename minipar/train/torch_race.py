"""`minipar bench train-vs-torch`: minipar's trainer against torch's own composition of
the same run (torch_native.py: FSDP2, DTensor tensor parallelism, torch's pipelining), the
`small` preset in fp32, the same weights and batches, one thread per rank.

For each composition the two take turns for `rounds` rounds; a row keeps the median
tokens/s of each and the per-round ratio (minipar / torch), whose spread is the noise.
The layouts are the same on both sides: torch's data parallelism is FSDP2 (torchtitan's
choice), so minipar's dp rows are its ZeRO-3, and with tp both run FSDP over the dp group
of a tensor-parallel model (torchtitan's "2D": minipar's `StageDataParallel` with
ZeRO-3 over the decoder cut for tp).

Why one side is slower is measured, not guessed: three more steps of each, after the
timed ones, run under torch's profiler, which splits the step's wall time into torch's
operators (self time of `aten::` ops on the main thread: the compute, plus copies) and
the rest (Python, hooks, waiting for messages), and counts the messages gloo carried
(`gloo:` events: each collective, send or receive).

A pipeline row also says how short its schedule could be: three more traced steps give
each stage's median forward (F) and backward (B; or input and weight gradients, I and W,
where the schedule splits it) as minipar's engine records them (a V's rank holds two
unequal stages, priced apart), and the schedule replayed with those costs and free
messages (`pipeline.simulate`) is the schedule's critical path at those median costs,
without the step's loss, norm and optimizer: about the step no implementation of that
schedule beats on these kernels. Both sides run the same kernels, so a step close to
that floor leaves either library nothing to win but the schedule itself.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from .. import trace
from ..pipeline import schedule, simulate
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster
from .bench import _ranks  # the ranks a layout's degrees need: one product for both benches
from .config import TrainConfig, load_config
from .data import BatchSampler, load_tokens
from .loop import build_part, train_step
from .optim import learning_rate
from .precision import LossScaler
from .torch_native import NativeRun

# row: (minipar's parallel settings, torch's, what each side runs)
ROWS = {
    "dp=2": (dict(dp=2, zero=3), dict(dp=2),
             "ZeRO-3, each block a unit", "FSDP2 fully_shard, each block a unit"),
    "tp=2": (dict(tp=2), dict(tp=2),
             "Megatron tp (mesh/decoder_layers.py)", "DTensor Colwise/RowwiseParallel"),
    "pp=2 1f1b m=4": (dict(pp=2, microbatches=4), dict(pp=2, microbatches=4),
                      "pipeline engine, 1F1B", "torch.distributed.pipelining Schedule1F1B"),
    "pp=2 zb_v m=4": (dict(pp=2, schedule="zb_v", virtual=2, microbatches=4),
                      dict(pp=2, schedule="zb_v", virtual=2, microbatches=4),
                      "pipeline engine, ZB-V (two stages per rank)",
                      "torch.distributed.pipelining ScheduleZBVZeroBubble"),
    "pp=2 dualpipev m=4": (dict(pp=2, schedule="dualpipev", virtual=2, microbatches=4),
                           dict(pp=2, schedule="dualpipev", virtual=2, microbatches=4),
                           "pipeline engine, DualPipeV (two stages per rank)",
                           "torch.distributed.pipelining ScheduleDualPipeV"),
    "dp=2 tp=2": (dict(dp=2, tp=2, zero=3), dict(dp=2, tp=2),
                  "ZeRO-3 over dp, Megatron tp", "FSDP2 over dp, DTensor tp"),
}
WARMUP = 2  # steps left out of the median: the first ones pay for allocation
PROFILED = ("wall", "ops", "messages")


def race_config(parallel: dict, steps: int, preset: str = "small",
                precision: str = "fp32") -> TrainConfig:
    """The race's run: `preset` with these degrees, `steps` steps, no evaluation."""
    return load_config(preset, {
        **{f"parallel.{k}": v for k, v in parallel.items()}, "train.precision": precision,
        "train.steps": steps, "optim.warmup_steps": 1, "train.eval_every": 0,
        "train.eval_batches": 1})


class Side:
    """One side of the race on this rank: `step(ids, targets, lr)` -> (batch loss,
    gradient norm), this rank's dp index and dp, and the weights under the twin's names."""

    def __init__(self, config: TrainConfig, native: bool) -> None:
        if native:
            self.run = NativeRun(config)
            self.dp_rank, self.dp = self.run.dp_rank, self.run.dp
        else:  # the trainer's own step (loop.py)
            self.part, self.scaler = build_part(config), LossScaler(enabled=False)
            self.dp_rank, self.dp = self.part.dp_rank, self.part.dp
        self.config, self.native = config, native

    def step(self, ids: torch.Tensor, targets: torch.Tensor, lr: float) -> tuple[float, float]:
        if self.native:
            return self.run.step(ids, targets, lr)
        loss, norm, _ = train_step(self.part, self.scaler, ids, targets, self.config, lr)
        return loss, norm

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's weights: whole under torch (FSDP2 and DTensor gather), as the trainer
        holds them (tp slices) under minipar; a pipeline stage's own layers."""
        if self.native:
            return self.run.full_parameters()
        return {n: w.clone() for n, w in self.part.full_parameters()}


def profile_step(step, repeats: int = 3) -> dict:
    """`step()` under torch's profiler, `repeats` times; the median of each: wall seconds,
    seconds in torch's operators (self time) and the number of gloo operations
    (collectives, sends and receives)."""
    from torch.profiler import ProfilerActivity, profile

    # the profiler's C++ side (kineto) prints two lines per use below this level; it reads
    # the variable when it first starts, in this process
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    seen = []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
        events = prof.events()
        # self time: an aten:: op called inside another is not counted twice
        ops = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::")) / 1e6
        seen.append({"wall": wall, "ops": ops,
                     "messages": sum(e.name.startswith("gloo:") for e in events)})
    return {k: statistics.median(s[k] for s in seen) for k in PROFILED}


def stage_costs(step, repeats: int = 3) -> dict[str, dict[int, float]]:
    """`repeats` more `step()`s, traced: for each stage this rank holds, the median seconds
    of each kind of its work, as the pipeline engine records it: forwards ("F"), backwards
    ("B"), or where the schedule splits the backward, input ("I") and weight ("W")
    gradients. {kind: {stage: seconds}}: a V's rank holds two unequal stages."""
    with trace.capture() as captured:
        for _ in range(repeats):
            step()
    seen: dict[str, dict[int, list[float]]] = {}
    for e in captured.events:
        if e.kind in ("F", "B", "I", "W"):
            seen.setdefault(e.kind, {}).setdefault(e.stage, []).append(e.duration)
    return {kind: {stage: statistics.median(times) for stage, times in by_stage.items()}
            for kind, by_stage in seen.items()}


def schedule_floor(config: TrainConfig, costs: list[dict[str, dict[int, float]]]) -> float:
    """Seconds of the config's pipeline schedule replayed with each stage's measured work
    (`stage_costs`, one dict per rank) and messages that cost nothing: the critical path
    of the schedule's arithmetic."""
    p = config.parallel
    plan = schedule(p.schedule, p.pp, p.microbatches, p.virtual)
    kinds = {kind for c in costs for kind in c}  # every rank's: F and B, or F, I and W
    per_stage = {kind: {s: t for c in costs for s, t in c.get(kind, {}).items()}
                 for kind in kinds}
    return simulate(plan, per_stage).makespan


def run_steps(config: TrainConfig, native: bool, profile: bool = False,
              keep_weights: bool = False) -> dict:
    """On every rank: the config's steps by one side, each step's loss, gradient norm and
    tokens/s; with `profile`, more steps under the profiler (`profile_step`); with
    `keep_weights`, the weights after the steps (`Side.weights`)."""
    side = Side(config, native)
    tokens = load_tokens(config.data.path, config.data.val_fraction, config.data.seed)
    loop = config.train
    sampler = BatchSampler(tokens.train, config.model.seq_len, loop.batch_size,
                           config.data.seed, side.dp_rank, side.dp)
    records = []
    for i in range(loop.steps):
        ids, targets = sampler.next()
        lr = learning_rate(i, config.optim, loop.steps)
        start = time.perf_counter()
        loss, norm = side.step(ids, targets, lr)
        seconds = time.perf_counter() - start
        records.append({"step": i + 1, "loss": loss, "grad_norm": norm,
                        "tokens_per_s": loop.batch_size * config.model.seq_len / seconds})
    out = {"records": records}
    if keep_weights:
        out["weights"] = side.weights()
    if profile:  # more steps, at the last step's rate (whose batches matter not)
        def again() -> tuple[float, float]:
            return side.step(*sampler.next(), config.optim.min_lr)
        out["profile"] = profile_step(again)
        if not native and config.parallel.pp > 1:
            out["profile"]["stage_costs"] = stage_costs(again)
    return out


def timed(config: TrainConfig, native: bool, profile: bool = True) -> dict:
    """On every rank, one thread: this side's median tokens/s (after WARMUP steps) and,
    with `profile`, its profiled step."""
    torch.set_num_threads(1)
    out = run_steps(config, native, profile=profile)
    speed = statistics.median(r["tokens_per_s"] for r in out["records"][WARMUP:])
    return {"tokens_per_s": speed, **out.get("profile", {})}


def measure(steps: int = 10, rounds: int = 5, preset: str = "small",
            rows: tuple[str, ...] = tuple(ROWS)) -> list[dict]:
    """Each row's two sides in turns for `rounds` rounds: tokens/s (the slowest rank's) and
    the last round's profiled step (the slowest rank's); a pipeline row, the floor of its
    schedule (`schedule_floor`) from minipar's last round."""
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"rows must be among {', '.join(ROWS)}; got {unknown}")
    runs = {(row, side): [] for row in rows for side in ("minipar", "torch")}
    floors: dict[str, float] = {}
    clusters = {k: Cluster(k, backend="gloo", timeout=300)
                for k in sorted({_ranks(ROWS[r][0]) for r in rows})}
    try:
        for round_index in range(rounds):
            for row in rows:
                for side, parallel in (("minipar", ROWS[row][0]), ("torch", ROWS[row][1])):
                    progress(f"{row}, {side}, round {round_index + 1}/{rounds}")
                    config = race_config(parallel, steps, preset)
                    # the table shows the last round's profiled step: only that round profiles
                    result = clusters[_ranks(parallel)].run(timed, config, side == "torch",
                                                            round_index == rounds - 1)
                    runs[row, side].append(min(result, key=lambda r: r["tokens_per_s"]))
                    if "stage_costs" in result[0]:
                        floors[row] = schedule_floor(config, [r["stage_costs"] for r in result])
    finally:
        for cluster in clusters.values():
            cluster.close()
    model = race_config({}, steps, preset)
    tokens_per_step = model.train.batch_size * model.model.seq_len
    out = []
    for row in rows:
        mine, theirs = runs[row, "minipar"], runs[row, "torch"]
        out.append({
            "composition": row, "minipar_layout": ROWS[row][2], "torch_layout": ROWS[row][3],
            "ranks": _ranks(ROWS[row][0]),
            "minipar_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "torch_tokens_per_s": statistics.median(r["tokens_per_s"] for r in theirs),
            "ratios": [a["tokens_per_s"] / b["tokens_per_s"]
                       for a, b in zip(mine, theirs, strict=True)],
            "rounds": [(a["tokens_per_s"], b["tokens_per_s"])  # (minipar, torch) in turns
                       for a, b in zip(mine, theirs, strict=True)],
            "minipar_profile": {k: mine[-1][k] for k in PROFILED},
            "torch_profile": {k: theirs[-1][k] for k in PROFILED},
            "tokens_per_step": tokens_per_step,
            **({"schedule_floor_s": floors[row]} if row in floors else {})})
    return out


def why(row: dict) -> str:
    """The profiled step of each side, side by side: where the time went."""
    a, b = row["minipar_profile"], row["torch_profile"]
    return (f"step {a['wall'] * 1e3:.0f} / {b['wall'] * 1e3:.0f} ms; torch ops "
            f"{a['ops'] * 1e3:.0f} / {b['ops'] * 1e3:.0f}; rest "
            f"{(a['wall'] - a['ops']) * 1e3:.0f} / {(b['wall'] - b['ops']) * 1e3:.0f}; "
            f"{a['messages']} / {b['messages']} gloo calls" + _floor(row))


def _floor(row: dict) -> str:
    """For a pipeline row: its schedule's floor beside each side's timed step."""
    if "schedule_floor_s" not in row:
        return ""
    steps = [row["tokens_per_step"] / row[f"{side}_tokens_per_s"] * 1e3
             for side in ("minipar", "torch")]
    return (f"; the schedule's floor {row['schedule_floor_s'] * 1e3:.0f} ms, timed steps "
            f"{steps[0]:.0f} / {steps[1]:.0f}")


def report(rows: list[dict], out_dir: Path) -> str:
    """The race table (tokens/s of each side, per-round ratios) and the profiled step of
    each (minipar / torch); JSON and a bar plot."""
    from matplotlib.figure import Figure

    shown = [{"composition": r["composition"], "ranks": r["ranks"],
              "minipar": f"{r['minipar_tokens_per_s']:,.0f}",
              "torch": f"{r['torch_tokens_per_s']:,.0f}",
              "ratio": ratio_cell(r["ratios"]), "why": why(r)} for r in rows]
    layouts = [f"  {r['composition']}: minipar {r['minipar_layout']}; torch "
               f"{r['torch_layout']}" for r in rows]
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["minipar_tokens_per_s"] for r in rows], height=0.4,
            label="minipar", color="#4C72B0")
    ax.barh([i - 0.2 for i in y], [r["torch_tokens_per_s"] for r in rows], height=0.4,
            label="torch (FSDP2, DTensor, pipelining)", color="#DD8452")
    ax.set_yticks(list(y), [r["composition"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("tokens per second (median of rounds)")
    ax.legend(loc="lower right", fontsize=8)
    save_results(rows, fig, out_dir, "train_vs_torch",
                 title="minipar's trainer against torch's own composition, same run")
    return "\n".join([
        "the same model, weights and batches (small preset, fp32, one thread per rank); "
        "the two sides take turns; ratio = minipar / torch tokens/s per round, median "
        "(min-max); above 1 minipar is faster",
        format_table(shown, [("composition", "composition"), ("ranks", "ranks"),
                             ("minipar", "minipar tok/s"), ("torch", "torch tok/s"),
                             ("ratio", "minipar / torch"),
                             ("why", "profiled step (median of 3), minipar / torch")]),
        "layouts:", *layouts,
        "torch ops: self time of aten:: operators on the main thread (compute and copies); "
        "rest: the step's other time (Python, hooks, waiting for messages); gloo calls: "
        "collectives, sends and receives"])
