"""The slow-networks demo (lesson 10): trainers that talk less (local SGD, CO2, Hogwild!,
top-k compression) or to fewer peers (gossip: SGP, grouped all-reduce) on the same small
regression task, a checkpointed run that loses a rank and resumes on fewer, and a
bilinear saddle-point problem solved by extragradient, uncompressed and compressed (MASHA1,
MASHA2), and ATOM's peers, each swapping a model bigger than its device budget. The
exact ones are checked against one process; the others are approximate by design and show
their loss (or distance) going down. `python -m minipar.slow_networks`, `minipar tour` and
the tests run `demo`."""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

from ..data_parallel import single_process_sgd, task
from ..data_parallel.compression import TopK, train_compressed
from ..demo import Check, Context, Row, run_cases, start_clock
from ..models import mlp, mse
from ..runtime import RankError, launch, rank, world_size
from .atom import train_atom
from .checkpoint_restart import train_resumable
from .gossip import train_gossip
from .masha import LABELS, STEP, compare
from .relaxed import train_relaxed
from .saddle import bilinear_problem, extragradient, extragradient_on_ranks

CASES = ("local_sgd", "co2", "hogwild", "top_k", "sgp_complete", "sgp", "grouped",
         "extragradient", "masha1", "masha2", "atom")


def _local_sgd() -> Check:
    _, ref_params = single_process_sgd(task.model(), task.batches(), mse, task.LR)
    start = start_clock()
    _, params = train_relaxed("local_sgd", task.model, task.batches(), mse, task.LR, local_steps=1)
    return Check("local SGD, H=1 (average every step)", task.same(params, ref_params),
                 time.perf_counter() - start, note="H=1 is synchronous SGD")


def _shared_file() -> str:
    """A path every rank maps for Hogwild!: rank 0 picks it, the others are told."""
    # broadcast_object_list fills the list in place: every rank passes a one-slot list
    path = [tempfile.mkstemp(prefix="minipar-hogwild-")[1] if rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


def _relaxed(method: str) -> Check:
    # hogwild maps raw float32 memory and refuses any other dtype
    dtype = torch.float32 if method == "hogwild" else torch.float64
    kwargs = {"shared_file": _shared_file()} if method == "hogwild" else {"local_steps": 4}
    start = start_clock()
    report, _ = train_relaxed(method, lambda: task.model(dtype), task.batches(24, dtype), mse,
                              task.LR, **kwargs)
    seconds = time.perf_counter() - start
    if method == "hogwild":
        dist.barrier()  # every rank is done with the shared file
        if rank() == 0:
            os.remove(kwargs["shared_file"])
    label = {"co2": "CO2-style local SGD, H=4, async average",
             "hogwild": "Hogwild!, lock-free shared memory"}[method]
    return Check(label, None, seconds, note=f"not exact by design; loss {report.losses[0]:.3f} "
                                            f"-> {report.losses[-1]:.3f}")


def _top_k() -> Check:
    batches = task.batches(24)
    start = start_clock()
    report = train_compressed(task.model(), batches, mse, task.LR, TopK(0.05))
    share = sum(report.payload_bytes) / (len(batches) * report.dense_bytes)
    return Check("data parallel, top-5% gradients + error feedback", None,
                 time.perf_counter() - start,
                 note=f"payload {share:.0%} of dense; loss {report.losses[0]:.3f} -> "
                      f"{report.losses[-1]:.3f}")


def _gossip(case: str) -> Check:
    """SGP on the complete graph (exact), on the exponential graph, and grouped pairs."""
    method, options, label = {
        "sgp_complete": ("sgp", {"graph": "complete"}, "SGP, complete graph (exact average)"),
        "sgp": ("sgp", {}, "SGP, exponential graph, one push a step"),
        "grouped": ("grouped", {"group_size": 2, "swap_every": 2},
                    "grouped all-reduce, pairs swapped every 2 steps")}[case]
    batches = task.batches(4 if case == "sgp_complete" else 24)
    start = start_clock()
    report, params = train_gossip(method, task.model, batches, mse, task.LR, **options)
    seconds = time.perf_counter() - start
    if case == "sgp_complete":
        _, reference = single_process_sgd(task.model(), batches, mse, task.LR)
        return Check(label, task.same(params, reference), seconds, sum(report.sent_bytes),
                     note="one push to everyone = all-reduce")
    return Check(label, None, seconds, sum(report.sent_bytes),
                 note=f"not exact by design; loss {report.losses[0]:.3f} -> "
                      f"{report.losses[-1]:.3f}, consensus distance {report.consensus[-1]:.1e}")


def _extragradient() -> Check:
    """Extragradient on ranks (F_m all-reduced) against one process's (F averaged in place)."""
    problem = bilinear_problem(20, world_size())
    gamma = STEP["extragradient"] / problem.lipschitz()
    z0 = torch.zeros(problem.dim, dtype=torch.float64, device=problem.A.device)
    reference = extragradient(problem.operator, z0, gamma, 40, problem.solution())
    start = start_clock()
    run = extragradient_on_ranks(problem, gamma, 40)
    # 1e-12: the ring adds the ranks' F_m in another order than one process's mean
    same = torch.allclose(run.z, reference.z, rtol=0, atol=1e-12)
    return Check("extragradient on a bilinear saddle point, uncompressed", same,
                 time.perf_counter() - start, run.sent_bytes[-1],
                 note=f"distance to the saddle {run.distances[0]:.2f} -> "
                      f"{run.distances[-1]:.1e} in 40 iterations")


def _masha(method: str) -> Check:
    """MASHA against extragradient: the bytes each sent (metered) to reach 1e-4 x the start's
    distance."""
    problem = bilinear_problem(50, world_size())
    start = start_clock()
    base, run = compare(problem, 5, 0.1, ("extragradient", method),
                        {"extragradient": 50, method: 350})
    seconds = time.perf_counter() - start
    mine, theirs = run.bytes_to_reach(1e-4), base.bytes_to_reach(1e-4)
    reached = (f"reached 1e-4 x the start's distance with {mine:,} bytes/rank, "
               f"{mine / theirs:.2f}x extragradient's {theirs:,}" if mine and theirs
               else "did not reach 1e-4 x the start's distance")
    return Check(LABELS[method] + ", k = 5 of 100", None, seconds, run.sent_bytes[-1],
                 note=f"not exact by design; {reached}")


def _deep_model() -> torch.nn.Module:
    """Eight equal hidden layers: a swapping device holds about three at a time."""
    return mlp([32] + [256] * 8 + [1], seed=7, dtype=torch.float64)


def _atom() -> Check:
    """ATOM: each peer swaps the whole model through 3/4 of its parameters' bytes, averaging
    every step (local SGD, H=1): synchronous SGD, so one process's run is the reference."""
    whole = sum(p.numel() * p.element_size() for p in _deep_model().parameters())
    _, reference = single_process_sgd(_deep_model(), task.batches(), mse, task.LR)
    start = start_clock()
    report, params = train_atom(_deep_model, task.batches(), mse, task.LR, local_steps=1,
                                method="local_sgd", budget=whole * 3 // 4)
    return Check("ATOM: model swapped through each peer, averaged every step",
                 task.same(params, reference), time.perf_counter() - start, report.sent_bytes,
                 note=f"device peak {report.peak / 1024:.0f} KiB under a {whole * 3 // 4 // 1024} "
                      f"KiB budget, model {whole // 1024} KiB; only averages sent")


def _killed_and_resumed(ctx: Context) -> Row:
    """Driver side: 4 ranks, rank 2 SIGKILLed at step 5, resumed on 3 ranks, against an
    uninterrupted 3-rank run (fresh processes: a death ends a run's group)."""
    with tempfile.TemporaryDirectory(prefix="minipar-checkpoint-") as folder, \
            tempfile.TemporaryDirectory(prefix="minipar-checkpoint-") as fresh_folder:
        run = (task.model, task.batches(8), mse, task.LR)
        start = time.perf_counter()
        try:
            launch(train_resumable, 4, *run, folder, 2, kill_at=(2, 5))
            died = False
        # the SIGKILL is the point: the first launch is expected to fail
        except RankError:
            died = True
        resumed = launch(train_resumable, 3, *run, folder, 2)
        seconds = time.perf_counter() - start
        fresh = launch(train_resumable, 3, *run, fresh_folder, 2)
    same = died and all(task.same(a[1], b[1]) for a, b in zip(resumed, fresh, strict=True))
    return Row("checkpoint, rank 2 killed, resumed on 3 of 4 ranks", 4, same, seconds,
               note=f"SIGKILL at step 5; resumed from step {8 - len(resumed[0][0])} (the last "
                    "checkpoint); final weights vs an uninterrupted 3-rank run")


RUNS = {"local_sgd": _local_sgd, "co2": lambda: _relaxed("co2"),
        "hogwild": lambda: _relaxed("hogwild"), "top_k": _top_k,
        # case=case binds each name now: a plain closure would see only the loop's last case
        **{case: (lambda case=case: _gossip(case)) for case in ("sgp_complete", "sgp",
                                                                 "grouped")},
        "extragradient": _extragradient, "masha1": lambda: _masha("masha1"),
        "masha2": lambda: _masha("masha2"), "atom": _atom}


def demo(cases: tuple[str, ...] = CASES) -> list[Check]:
    """On every rank: run each named trainer (see RUNS) on the same small regression task."""
    return run_cases(RUNS, cases)


def tour(ctx: Context) -> list[Row]:
    return (ctx.checks(2, demo, ("local_sgd", "co2", "hogwild", "top_k", "extragradient",
                                 "masha1", "masha2", "atom"))
            + ctx.checks(4, demo, ("sgp_complete", "sgp", "grouped"))
            + [_killed_and_resumed(ctx)])
