"""PipeFisher on real ranks: train a pipeline with SGD or with K-FAC, its curvature work
done after each step or placed in the bubbles the simulator finds from measured costs;
and the one-process K-FAC every pipelined run is held to."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from .. import trace
from ..models import mse
from ..runtime import device, rank, world_size
from .engine import Pipeline, split_model
from .kfac import KFAC, kfac_step
from .plan import Action
from .schedules import schedule
from .simulate import bubble_budgets, costs_from_timeline

OPTIMIZERS = ("sgd", "adam", "kfac")


def _check(optimizer: str, lr: float) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0; got {lr!r}")


def _optimizer(params: list[nn.Parameter], optimizer: str, lr: float
               ) -> torch.optim.Optimizer:
    """Adam, or SGD (which K-FAC's preconditioned gradients also go through)."""
    return torch.optim.Adam(params, lr=lr) if optimizer == "adam" \
        else torch.optim.SGD(params, lr=lr)


class BubbleWork:
    """PipeFisher's placement, the engine's extra work (`Pipeline.fill_bubbles`): before
    each of this rank's actions whose index is in `budgets`, call work(seconds), filling
    the time the rank would otherwise wait there (`simulate.bubble_budgets` finds it)."""

    def __init__(self, work: Callable[[float], float], budgets: dict[int, float]) -> None:
        self.work, self.budgets = work, dict(budgets)

    def before(self, index: int, action: Action) -> None:
        if self.budgets.get(index, 0.0) > 0:
            self.work(self.budgets[index])


def kfac_one_process(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     lr: float, damping: float = 1e-3, optimizer: str = "kfac",
                     every: int = 1) -> tuple[list[float], list[torch.Tensor]]:
    """The reference: one process, whole batches, SGD on the (K-FAC preconditioned)
    gradient of the mean squared error, or Adam. Returns the losses and the final
    parameters."""
    _check(optimizer, lr)
    kfac = KFAC([model], damping) if optimizer == "kfac" else None
    opt = _optimizer(list(model.parameters()), optimizer, lr)
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = mse(model(x), y)
        loss.backward()
        if kfac is not None:
            kfac_step(kfac, step, every)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def train_pipefisher(model_fn: Callable[[], nn.Sequential], batches: list, name: str = "1f1b",
                     microbatches: int = 4, lr: float = 0.1, optimizer: str = "kfac",
                     fill: bool = True, damping: float = 1e-3, every: int = 1) -> dict:
    """Train `model_fn()` cut into one stage per rank on `batches` with schedule `name`.

    With K-FAC, the first two steps run its curvature work after the step; then the ranks
    share their events of step 1, every rank reads the costs off that Timeline and
    simulates the schedule with them, and (`fill=True`) this rank runs curvature units
    before each receive it would wait at, for as long as the simulator says it waits.
    Returns per step the loss (on the last stage's rank), step seconds and the time this
    rank spent on K-FAC; how many units ran in bubbles and after steps; and the final
    parameters of this rank's stage.
    """
    _check(optimizer, lr)
    k = world_size()
    plan = schedule(name, k, microbatches)
    pipe = Pipeline(split_model(model_fn(), k), plan)
    kfac = KFAC(pipe.modules.values(), damping) if optimizer == "kfac" else None
    opt = _optimizer(pipe.parameters(), optimizer, lr)
    out: dict = {"losses": [], "seconds": [], "kfac_seconds": []}
    for step, (x, y) in enumerate(batches):
        x, y = x.to(device()), y.to(device())  # the caller's batches may be on the host
        dist.barrier()
        measuring = kfac is not None and fill and step == 1  # step 0 sent shape headers
        with trace.capture() if measuring else nullcontext() as captured:
            start, before = time.perf_counter(), kfac.seconds if kfac else 0.0
            loss = pipe.train_step(x, y, mse)
            if kfac is not None:
                kfac_step(kfac, step, every)
            opt.step()
            opt.zero_grad()
            seconds = time.perf_counter() - start
        out["losses"].append(loss)
        out["seconds"].append(seconds)
        out["kfac_seconds"].append(kfac.seconds - before if kfac else 0.0)
        if measuring:  # every rank builds the same whole-step Timeline and costs
            everyone = [None] * k
            dist.all_gather_object(everyone, captured.events)
            step_timeline = trace.Timeline(e for events in everyone for e in events)
            costs = costs_from_timeline(step_timeline, plan)
            pipe.fill_bubbles(BubbleWork(kfac.work, bubble_budgets(plan, costs)[rank()]))
    if kfac is not None:
        out["units_in_bubbles"], out["units_after_step"] = (kfac.units_in_bubbles,
                                                            kfac.units_after_step)
    out["parameters"] = [p.detach().clone() for p in pipe.parameters()]
    return out
