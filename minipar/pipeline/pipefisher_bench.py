"""`minipar bench pipefisher`: K-FAC in a pipeline's bubbles (PipeFisher) on 2 CPU
ranks. Convergence: SGD, Adam and K-FAC, each at its best learning rate, on an
ill-conditioned regression. Utilization: step time with no curvature work, with K-FAC's
work after each step, and with it placed in the bubbles, measured in turns."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from torch import nn

from ..report import format_table, progress, save_results, spread
from ..runtime import Cluster, device
from .pipefisher import kfac_one_process, train_pipefisher

LEARNING_RATES = {"sgd": (0.1, 0.3, 1.0), "adam": (0.003, 0.01, 0.03),
                  "kfac": (0.1, 0.3, 1.0)}
DAMPING = 0.1
REFRESH_EVERY = 4  # steps per curvature refresh in the timing runs: one step's bubbles are small


def regression_model(width: int = 64, inputs: int = 16, outputs: int = 4) -> nn.Sequential:
    """Four linear layers with tanh between them (two per stage on 2 ranks), seeded."""
    torch.manual_seed(0)
    # seeded on the host, then moved: the same model on any device
    model = nn.Sequential(nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, width),
                          nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, outputs))
    return model.to(device())


def ill_conditioned_batches(steps: int, rows: int, inputs: int = 16, outputs: int = 4,
                            seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs whose features span a factor of 1000 in scale, targets from a fixed random
    linear teacher: plain gradient descent crawls along the small directions."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1.5, 1.5, inputs)
    teacher = torch.randn(inputs, outputs, generator=generator) / scales[:, None]
    batches = []
    for _ in range(steps):
        x = torch.randn(rows, inputs, generator=generator) * scales
        batches.append((x, torch.tanh(x @ teacher)))
    return batches


def _best_rate(optimizer: str, batches: list) -> float:
    """The learning rate of LEARNING_RATES[optimizer] that ends lowest, on one process."""
    final = {}
    for lr in LEARNING_RATES[optimizer]:
        try:
            losses, _ = kfac_one_process(regression_model(), batches, lr, DAMPING, optimizer)
        except FloatingPointError:  # diverged
            continue
        if all(v == v for v in losses):  # no NaN
            final[lr] = losses[-1]
    return min(final, key=final.get)


def _width_model(width: int):
    return lambda: regression_model(width=width, inputs=width)


def measure(steps: int = 40, rows: int = 256, width: int = 256, timed_steps: int = 8,
            rounds: int = 3, timed_microbatches: int = 1) -> list[dict]:
    """Loss per step for each optimizer (pipeline, 2 ranks, 1F1B with 2 micro-batches);
    then the mean step time of SGD, K-FAC after the step and K-FAC in the bubbles, in
    turns, with `timed_microbatches` (1: each rank idles while the other computes) and the
    curvature refreshed every REFRESH_EVERY steps, its work spread over them."""
    rows_out = []
    batches = ill_conditioned_batches(steps, rows)
    with Cluster(2, backend="gloo") as cluster:
        for optimizer in ("sgd", "adam", "kfac"):
            lr = _best_rate(optimizer, batches)
            progress(f"convergence: {optimizer} (lr {lr}) on the pipeline")
            run = cluster.run(train_pipefisher, regression_model, batches, "1f1b", 2, lr,
                              optimizer, True, DAMPING)
            rows_out.append({"kind": "convergence", "optimizer": optimizer, "lr": lr,
                             "losses": run[1]["losses"]})
        generator = torch.Generator().manual_seed(2)
        timed = [(torch.randn(1024, width, generator=generator),
                  torch.randn(1024, 4, generator=generator)) for _ in range(timed_steps + 2)]
        variants = [("SGD, no curvature", "sgd", False), ("K-FAC after the step", "kfac", False),
                    ("K-FAC in the bubbles", "kfac", True)]
        steps_by = {name: [] for name, _, _ in variants}
        kfac_by = {name: [] for name, _, _ in variants}
        placed = {name: [0, 0] for name, _, _ in variants}
        for r in range(rounds):
            for name, optimizer, fill in variants:
                progress(f"utilization: {name}, round {r + 1}/{rounds}")
                run = cluster.run(train_pipefisher, _width_model(width), timed, "1f1b",
                                  timed_microbatches, 0.01, optimizer, fill, DAMPING,
                                  REFRESH_EVERY)
                per_step = [max(a, b) for a, b in zip(run[0]["seconds"], run[1]["seconds"],
                                                      strict=True)][2:]
                steps_by[name].append(statistics.mean(per_step))  # refreshes are periodic
                kfac_by[name].append(statistics.mean(  # per rank and step
                    (a + b) / 2 for a, b in zip(run[0]["kfac_seconds"][2:],
                                                run[1]["kfac_seconds"][2:], strict=True)))
                for part in run:
                    placed[name][0] += part.get("units_in_bubbles", 0)
                    placed[name][1] += part.get("units_after_step", 0)
        for name, _, _ in variants:
            rows_out.append({"kind": "utilization", "variant": name,
                             "microbatches": timed_microbatches, "width": width,
                             "step_seconds": steps_by[name], "kfac_seconds": kfac_by[name],
                             "units_in_bubbles": placed[name][0],
                             "units_after_step": placed[name][1],
                             "vs_sgd": [t / s for t, s in zip(steps_by[name],
                                                              steps_by["SGD, no curvature"],
                                                              strict=True)]})
    return rows_out


def report(rows: list[dict], out_dir: Path) -> str:
    """Loss at a few steps per optimizer and step time per placement; JSON and a plot."""
    from matplotlib.figure import Figure

    convergence = [r for r in rows if r["kind"] == "convergence"]
    utilization = [r for r in rows if r["kind"] == "utilization"]
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for r in convergence:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['optimizer']} (lr "
                f"{r['lr']})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    save_results(rows, fig, out_dir, "pipefisher",
                 title="PipeFisher: training loss by optimizer, 2-stage pipeline, "
                       "ill-conditioned regression")
    last = len(convergence[0]["losses"])
    marks = sorted({s for s in (1, 5, 10, 20) if s < last} | {last})
    loss_table = format_table(
        [{"optimizer": f"{r['optimizer']} (lr {r['lr']})",
          **{str(s): f"{r['losses'][s - 1]:.4f}" for s in marks}} for r in convergence],
        [("optimizer", "optimizer (best lr)")] + [(str(s), f"step {s}") for s in marks])
    time_table = format_table(
        [{"variant": r["variant"], "step": spread([t * 1e3 for t in r["step_seconds"]], " ms", 1),
          "kfac": spread([t * 1e3 for t in r["kfac_seconds"]], " ms", 1),
          "vs": spread(r["vs_sgd"]),
          "placed": f"{r['units_in_bubbles']} / {r['units_after_step']}"} for r in utilization],
        [("variant", "curvature work"), ("step", "step (min-max over rounds)"),
         ("kfac", "K-FAC time per step"), ("vs", "vs SGD"),
         ("placed", "units in bubbles / after step")])
    return ("training loss on the pipeline (each optimizer at its best learning rate of three, "
            "found on one process):\n" + loss_table
            + f"\nmean step time, 2 ranks, 1F1B with {utilization[0]['microbatches']} "
            f"micro-batch(es), width {utilization[0]['width']}, curvature refreshed every "
            f"{REFRESH_EVERY} steps (rounds in turns):\n"
            + time_table)
