"""`minipar bench train`: the trainer's tokens per second and MFU on this machine, the
`small` preset, one process against compositions of 2, 4 and 8 ranks, fp32 against
bf16, each composition beside the planner's predicted step time, and each rank's memory
(the fullest rank's, measured by kind in the run's untimed last step, memory_report.py) beside
the prediction, and where a row's step goes: its median step split into the CPU time of
the thread that ran it, of the process's other threads (the communication thread, gloo's)
and of neither, when the rank waited for another or another process held the core
(metrics.StepClock); and, for rows of several ranks, each rank's own CPU in its median
step, fastest to slowest: ranks that compute the same rows at different paces (two
vCPUs a host shares unevenly) make a synchronous step wait for the slower one, and how
much that costs a step: the slower rank's own CPU over the ranks' mean, step by step,
averaged (`slower_rank_lead`).

Every rank computes on one thread, and so does the one-process baseline, so "dp=2 on 2
cores" compares like with like; a one-process row on every core is shown too, so that
nobody is misled about what one process can do. Four and eight ranks on this machine's
2 cores time-share them: their rows show what composing costs in messages and waiting,
not a speed-up. The variants take turns for `rounds` rounds; a row keeps the median round and
the per-round ratios, whose spread is the noise. One more row runs no composition at all:
two one-process runs of half the batch each, at once, on the two cores, with no
message between them (`CEILING`), each at its own pace (their tokens/s added). That is
what dp=2 would reach if its reductions were free and neither rank ever waited for the
other, so the row says how much of the gap to 2x is the two processes slowing each other
down through the caches and memory they share; a line under the table gives dp=2 over
the ceiling, round by round: what the reductions and the waiting cost together. Another
row (`NO_REDUCTIONS`) is dp=2 with its gradient reductions skipped, a stopwatch: its line
splits that gap into stepping together and the reductions (dp_references.py). MFU
divides by the peak measured for the dtype on one thread on the model's own projections
(matmul_peak.py), times the cores in use; the header gives the fp32 and bf16 peaks and
the CPU's kind.

The planner (`mesh.planner.estimate`) predicts each fp32 composition's step from
constants measured here: the compute rate of the one-process fp32 row (in the planner's
own FLOP count, so its counting convention cancels), alpha and beta from a ping-pong,
the optimizer's memory rate from timed Adam steps. It has no context parallelism, so cp
rows have no prediction. The report gives the rank correlation (Spearman) of predicted
against measured steps.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import cost
from ..collectives import fit_machine
from ..decoder import DecoderConfig, decoder
from ..mesh.bench import spearman, this_machine
from ..mesh.planner import OPTIMIZER_BYTES_PER_PARAM, Layout, estimate
from ..report import format_table, progress, ratio_cell, save_results
from ..runtime import Cluster
from .config import TrainConfig, load_config
from .device_peak import precision_verdict
from .dp_references import CEILING, NO_REDUCTIONS, against_references, gradient_reductions_skipped
from .loop import train

ONE_THREAD, EVERY_CORE = 1, os.cpu_count() or 1
# name: (parallel degrees and techniques, precision, threads per rank)
VARIANTS = {
    "1 process, fp32": ({}, "fp32", ONE_THREAD),
    "1 process, bf16": ({}, "bf16", ONE_THREAD),
    "1 process, fp32, every core": ({}, "fp32", EVERY_CORE),
    "dp=2, fp32": (dict(dp=2), "fp32", ONE_THREAD),
    "dp=2, bf16": (dict(dp=2), "bf16", ONE_THREAD),
    "dp=2 zero=1, fp32": (dict(dp=2, zero=1), "fp32", ONE_THREAD),
    "dp=2 zero=2, fp32": (dict(dp=2, zero=2), "fp32", ONE_THREAD),
    "dp=2 zero=3, fp32": (dict(dp=2, zero=3), "fp32", ONE_THREAD),
    "tp=2, fp32": (dict(tp=2), "fp32", ONE_THREAD),
    "tp=2 sp, fp32": (dict(tp=2, sequence_parallel=True), "fp32", ONE_THREAD),
    "pp=2 1f1b m=4, fp32": (dict(pp=2, microbatches=4), "fp32", ONE_THREAD),
    "cp=2, fp32": (dict(cp=2), "fp32", ONE_THREAD),
    "dp=2 tp=2, fp32": (dict(dp=2, tp=2), "fp32", ONE_THREAD),
    "dp=2 pp=2 m=4, fp32": (dict(dp=2, pp=2, microbatches=4), "fp32", ONE_THREAD),
    "pp=2 tp=2 m=4, fp32": (dict(pp=2, tp=2, microbatches=4), "fp32", ONE_THREAD),
    "dp=2 cp=2, fp32": (dict(dp=2, cp=2), "fp32", ONE_THREAD),
    "tp=2, bf16": (dict(tp=2), "bf16", ONE_THREAD),
    "pp=2 1f1b m=4, bf16": (dict(pp=2, microbatches=4), "bf16", ONE_THREAD),
    "cp=2, bf16": (dict(cp=2), "bf16", ONE_THREAD),
    "dp=8, fp32": (dict(dp=8), "fp32", ONE_THREAD),
    "dp=4 pp=2 m=4, fp32": (dict(dp=4, pp=2, microbatches=4), "fp32", ONE_THREAD),
    "dp=2 pp=2 tp=2 m=4, fp32": (dict(dp=2, pp=2, tp=2, microbatches=4), "fp32", ONE_THREAD),
}
BASELINE = "1 process, fp32"
WARMUP = 2  # steps left out of the median: the first ones pay for allocation
# a rank silent this long has hung: a bf16 row on a CPU without fast bf16 takes 5 s a step,
# and its first run times the peak too (20 s or more)
TIMEOUT_S = 300


def _ranks(parallel: dict) -> int:
    return (parallel.get("dp", 1) * parallel.get("pp", 1) * parallel.get("tp", 1)
            * parallel.get("cp", 1))


# a step's split as metrics.StepClock records it: the CPU of the thread that ran it, of the
# process's other threads, neither's (waiting, off the cores), and the step's wall time
SPLIT = ("cpu_seconds", "other_cpu_seconds", "idle_seconds", "seconds")


def _timed_run(config: TrainConfig, threads: int) -> dict:
    """Median tokens/s and MFU of a short run on this rank, on `threads` threads, the
    median step's split (`SPLIT`), the peak per core its MFU divides by, and this rank's
    memory (bytes, all kinds together) measured and predicted."""
    torch.set_num_threads(threads)
    run = train(config)
    records = run.records[WARMUP:]
    middle = sorted(records, key=lambda r: r["seconds"])[len(records) // 2]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "mfu": statistics.median(r["mfu"] for r in records),
            "split": {k: middle[k] for k in SPLIT},
            "peak_per_core": run.peak.per_device,
            "matmuls_per_core": run.peak.matmuls,
            "own_cpu_steps": [r["cpu_seconds"] for r in records],
            "memory": sum(run.memory["measured"].values()),
            "memory_predicted": sum(run.memory["predicted"].values())}


def _stopwatch_run(config: TrainConfig, threads: int) -> dict:
    """`_timed_run` with the gradient all-reduces skipped (dp_references.py: `NO_REDUCTIONS`);
    raises after the run if it skipped none, rather than print full dp=2 under the row's
    name."""
    with gradient_reductions_skipped() as skipped:
        run = _timed_run(config, threads)
    if not skipped[0]:
        raise RuntimeError(f"the row {NO_REDUCTIONS!r} skipped no gradient reduction: the "
                           "trainer's dp=2 no longer reduces through DataParallel; update "
                           "dp_references.py")
    return run


def _paces(runs: list[dict]) -> dict:
    """How unevenly ranks given the same work computed it: `pace`, the fastest and the
    slowest rank's own CPU in its median step; `lead`, `slower_rank_lead`."""
    own = [r["split"]["cpu_seconds"] for r in runs]
    return {"pace": [min(own), max(own)], "lead": slower_rank_lead(runs)}


def slower_rank_lead(runs: list[dict]) -> float:
    """The slower rank's own CPU over the ranks' mean, step by step, averaged over the
    steps: what a synchronous step pays, beyond its messages, for ranks that compute at
    different paces (the faster waits). The own CPU of a step moves from one step to
    the next on a shared host; a one-off trace on an AVX2-only EPYC found the two ranks'
    difference barely correlated with the step before (lag 1: -0.16 and +0.19 in two runs), so
    no split of rows by last step's speed would win it back (docs/trainer.md)."""
    steps = zip(*(r["own_cpu_steps"] for r in runs), strict=True)
    return statistics.fmean(max(own) - statistics.fmean(own) for own in steps)


def _side_by_side(clusters: list[Cluster], config: TrainConfig) -> dict:
    """Each one-rank cluster runs `config` on one thread, all at once, with no messages
    between them: their tokens/s added, their MFU's mean, the fullest one's memory."""
    with ThreadPoolExecutor(len(clusters)) as pool:  # one thread per cluster: they run at once
        runs = list(pool.map(lambda c: c.run(_timed_run, config, ONE_THREAD)[0], clusters))
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in runs),
            "mfu": statistics.mean(r["mfu"] for r in runs),
            "split": {k: statistics.mean(r["split"][k] for r in runs) for k in SPLIT},
            # the lead: what their paces would have cost them had they waited for each other
            **_paces(runs),
            "peak_per_core": runs[0]["peak_per_core"],
            "matmuls_per_core": runs[0]["matmuls_per_core"],
            "memory": max(r["memory"] for r in runs),
            "memory_predicted": max(r["memory_predicted"] for r in runs)}


def planner_model(c: DecoderConfig) -> cost.TransformerConfig:
    """The decoder in the planner's terms: SwiGLU's three matrices of width f counted as a
    two-matrix MLP of width 1.5 f (the same FLOPs); grouped-query attention's smaller K
    and V are counted as full ones (a few percent more on this shape; the compute rate is
    measured in the same count, so it cancels)."""
    return cost.TransformerConfig(c.layers, c.hidden, c.heads, c.seq_len, c.vocab_size,
                                  ffn=3 * c.ffn // 2)


def _adam_bytes_per_s(config: TrainConfig, steps: int = 3) -> float:
    """Bytes/s the Adam step streams on one thread, counted as the planner counts them."""
    torch.set_num_threads(ONE_THREAD)
    model = decoder(config.model)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    adam = torch.optim.Adam(params, foreach=False)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        adam.step()
        times.append(time.perf_counter() - start)
    return sum(p.numel() for p in params) * OPTIMIZER_BYTES_PER_PARAM / min(times[1:])


def predicted_step(config: TrainConfig, flops: float, bandwidth: float, alpha: float,
                   beta: float) -> float | None:
    """The planner's step time for the config's (dp, pp, tp) on this machine's constants;
    None with cp > 1 (the planner does not model it)."""
    p, t = config.parallel, config.train
    if p.cp > 1:
        return None
    ranks = p.dp * p.pp * p.tp
    # accumulation chunks are more micro-batches to the planner: the same compute and bubble
    per_micro = t.batch_size // (p.dp * p.microbatches * t.accumulation)
    layout = Layout(p.dp, p.pp, p.tp, micro_batch=per_micro, zero=p.zero,
                    recompute=t.recompute)
    machine = this_machine(ranks, flops, bandwidth, alpha, beta)
    return estimate(planner_model(config.model), machine, t.batch_size, layout,
                    bytes_per_value=4).step


def _config(preset: str, parallel: dict, precision: str, steps: int,
            batch_size: int | None = None) -> TrainConfig:
    """The bench's run of `preset` (`batch_size` replaces the preset's: CEILING's half)."""
    overrides = {**{f"parallel.{k}": v for k, v in parallel.items()},
                 "train.precision": precision, "train.steps": steps,
                 "optim.warmup_steps": 1, "train.eval_every": 0, "train.eval_batches": 1}
    if batch_size is not None:
        overrides["train.batch_size"] = batch_size
    return load_config(preset, overrides)


def _spec(name: str) -> tuple[dict, str, int]:
    """A row's (parallel degrees, precision, threads per rank); CEILING's and NO_REDUCTIONS's
    are dp=2's."""
    return (dict(dp=2), "fp32", ONE_THREAD) if name in (CEILING, NO_REDUCTIONS) else VARIANTS[name]


# the rows in the order they run and print: dp=2's references beside the data-parallel rows
ROWS = [*list(VARIANTS)[:4], CEILING, NO_REDUCTIONS, *list(VARIANTS)[4:]]


def measure(steps: int = 12, rounds: int = 3, preset: str = "small",
            rows: tuple[str, ...] = tuple(ROWS)) -> list[dict]:
    """Each of `rows`' median tokens/s and MFU, the rows in turns for `rounds` rounds, and
    the planner's prediction for each fp32 composition. `rows` must include `BASELINE`,
    which every ratio divides by (train/dp_bench.py measures data parallelism's rows alone)."""
    unknown = [name for name in rows if name not in ROWS]
    if unknown or BASELINE not in rows:
        raise ValueError(f"rows must be among the bench's ({', '.join(ROWS)}) and include "
                         f"{BASELINE!r}; got {list(rows)}")
    rows = tuple(name for name in ROWS if name in rows)  # the table's order, each once
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    # 2 ranks always: the ping-pong that fits alpha and beta for the planner runs on them
    sizes = sorted({2, *(_ranks(_spec(name)[0]) for name in rows)})
    clusters = {k: Cluster(k, backend="gloo", timeout=TIMEOUT_S) for k in sizes}
    # CEILING's second process: a one-rank cluster beside clusters[1]
    alone = [clusters[1], *([Cluster(1, backend="gloo", timeout=TIMEOUT_S)]
                            if CEILING in rows else [])]
    try:
        progress("fitting alpha and beta (ping-pong) and the optimizer's memory rate")
        fitted = fit_machine(clusters[2], save=False)
        bandwidth = clusters[1].run(_adam_bytes_per_s, _config(preset, {}, "fp32", 1))[0]
        half = _config(preset, {}, "fp32", steps).train.batch_size // 2
        for round_index in range(rounds):
            for name in rows:
                progress(f"{name}, round {round_index + 1}/{rounds}")
                if name == CEILING:
                    runs[name].append(_side_by_side(alone, _config(preset, {}, "fp32", steps,
                                                                   batch_size=half)))
                    continue
                parallel, precision, threads = _spec(name)
                config = _config(preset, parallel, precision, steps)
                result = clusters[_ranks(parallel)].run(
                    _stopwatch_run if name == NO_REDUCTIONS else _timed_run, config, threads)
                # the slowest rank sets the pace; the fullest rank sets the memory
                runs[name].append({**min(result, key=lambda r: r["tokens_per_s"]),
                                   **_paces(result),
                                   "memory": max(r["memory"] for r in result),
                                   "memory_predicted": max(r["memory_predicted"]
                                                           for r in result)})
    finally:
        for cluster in [*clusters.values(), *alone[1:]]:
            cluster.close()
    base = runs[BASELINE]
    tokens = _config(preset, {}, "fp32", 1)
    tokens_per_step = tokens.train.batch_size * tokens.model.seq_len
    # the compute rate in the planner's FLOP count, from the one-process fp32 row
    flops = (sum(cost.transformer_flops(planner_model(tokens.model)).values())
             * statistics.median(r["tokens_per_s"] for r in base))
    measured = []
    for name in rows:
        parallel, precision, threads = _spec(name)
        speeds = [r["tokens_per_s"] for r in runs[name]]
        middle = sorted(runs[name], key=lambda r: r["tokens_per_s"])[len(speeds) // 2]
        config = _config(preset, parallel, precision, steps)
        predicted = (predicted_step(config, flops, bandwidth, fitted.alpha, fitted.beta)
                     if precision == "fp32" and threads == ONE_THREAD and name in VARIANTS
                     else None)
        measured.append({"variant": name, "ranks": _ranks(parallel), "precision": precision,
                         "threads": threads, "tokens_per_s": statistics.median(speeds),
                         "tokens_per_s_range": [min(speeds), max(speeds)],
                         "mfu": statistics.median(r["mfu"] for r in runs[name]),
                         "peak_per_core": runs[name][0]["peak_per_core"],
                         "matmuls_per_core": runs[name][0]["matmuls_per_core"],
                         "step_s": tokens_per_step / statistics.median(speeds),
                         "step_split_s": middle["split"],
                         "pace_s": middle["pace"],
                         "slower_rank_lead_s": middle["lead"],
                         "predicted_step_s": predicted,
                         "memory": runs[name][-1]["memory"],
                         "memory_predicted": runs[name][-1]["memory_predicted"],
                         "vs_one_process": [mine["tokens_per_s"] / one["tokens_per_s"]
                                            for one, mine in zip(base, runs[name], strict=True)]})
    return measured


def correlations(rows: list[dict]) -> dict[int, float]:
    """Per number of ranks (with at least 3 predicted rows): Spearman's rho of predicted
    against measured step times."""
    out = {}
    for k in sorted({r["ranks"] for r in rows}):
        same = [r for r in rows if r["ranks"] == k and r["predicted_step_s"] is not None]
        if len(same) >= 3:
            out[k] = spearman([r["predicted_step_s"] for r in same], [r["step_s"] for r in same])
    return out


def peaks_line(rows: list[dict]) -> str:
    """The peaks per core the one-process rows' MFU divides by, by precision, and what
    bf16's matmuls mean here. Every row times its own shapes (dp and micro-batches shrink
    the rows a pass multiplies), so the first one-thread row of each precision speaks."""
    peak: dict[str, float] = {}
    matmuls: dict[str, float | None] = {}
    for r in rows:
        if r["threads"] == ONE_THREAD:
            peak.setdefault(r["precision"], r["peak_per_core"])
            matmuls.setdefault(r["precision"], r.get("matmuls_per_core"))
    line = "MFU divides by each row's peak per core, on its own shapes (the faster of the " \
        "model's matmuls and its fused attention, one thread); one process's: " + \
        ", ".join(f"{p} {v / 1e9:.3g} GFLOP/s" for p, v in peak.items())
    if matmuls.get("fp32") and matmuls.get("bf16"):
        line += f"; {precision_verdict('bf16', matmuls['bf16'] / matmuls['fp32'])}"
    return line


def report(rows: list[dict], out_dir: Path, name: str = "train") -> str:
    """Tokens/s, MFU, the per-round ratio to one fp32 process and the planner's step beside
    the measured one; JSON and a bar plot (bench_`name`.json and .png)."""
    from matplotlib.figure import Figure

    shown = [{"variant": r["variant"], "tokens/s": f"{r['tokens_per_s']:,.0f}",
              "mfu": f"{r['mfu']:.0%}", "ratio": ratio_cell(r["vs_one_process"]),
              "step": f"{r['step_s'] * 1e3:.0f} ms",
              "split": " + ".join(f"{r['step_split_s'][k] * 1e3:.0f}" for k in SPLIT[:3])
              + f" of {r['step_split_s']['seconds'] * 1e3:.0f}",
              # one rank has no pace to compare (the ceiling counts as dp=2's two processes)
              "pace": ("-" if r["ranks"] == 1 else
                       "-".join(f"{v * 1e3:.0f}" for v in r["pace_s"])),
              "lead": "-" if r["ranks"] == 1 else f"+{r['slower_rank_lead_s'] * 1e3:.0f} ms",
              "predicted": ("-" if r["predicted_step_s"] is None else
                            f"{r['predicted_step_s'] * 1e3:.0f} ms "
                            f"({r['predicted_step_s'] / r['step_s'] - 1:+.0%})"),
              "memory": f"{r['memory'] / 2**20:.1f} / {r['memory_predicted'] / 2**20:.1f}"}
             for r in rows]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.barh([r["variant"] for r in rows][::-1], [r["tokens_per_s"] for r in rows][::-1],
            xerr=[[r["tokens_per_s"] - r["tokens_per_s_range"][0] for r in rows][::-1],
                  [r["tokens_per_s_range"][1] - r["tokens_per_s"] for r in rows][::-1]],
            color="#4C72B0", capsize=2)
    ax.set_xlabel("tokens per second (median of rounds, min-max)")
    save_results(rows, fig, out_dir, name,
                 title="the trainer on this machine: tokens/s by composition and precision")
    rho = [f"{k} ranks: Spearman rank correlation, predicted vs measured step = {v:+.2f}"
           for k, v in correlations(rows).items()]
    return "\n".join([
        peaks_line(rows),
        "the variants take turns; each rank (and the baseline) on one thread unless said; "
        "ratios per round, median (min-max); predicted: the planner's step on this "
        "machine's fitted constants (its error in brackets; no model of cp); memory: the "
        "fullest rank, every kind together, measured in the run's last, untimed step / "
        "the cost model's formulas (memory_report.py); the median round's median step (the "
        "slowest rank's; the ceiling's, its two processes' mean), in ms: the CPU of the "
        "thread that ran it + the process's other threads' (the communication thread, "
        "gloo's, torch's intra-op pool: more than the step where they ran at once) + "
        "neither (waiting for another rank, or off the cores while another process ran) "
        "of the step; own CPU by rank: each rank's own CPU in its median step, fastest-"
        "slowest, in ms; slower rank: its own CPU over the ranks' mean, per step, averaged "
        "over the median round's steps (the ceiling's: what its two processes' paces would "
        "have cost had they waited for each other)",
        format_table(shown, [("variant", "variant"), ("tokens/s", "tokens/s"), ("mfu", "MFU"),
                             ("ratio", "vs 1 process, fp32"), ("step", "step"),
                             ("split", "median step: own CPU + others + neither"),
                             ("pace", "own CPU by rank"),
                             ("lead", "slower rank"),
                             ("predicted", "predicted step"),
                             ("memory", "fullest rank MiB (measured / predicted)")]),
        *against_references(rows), *rho])
