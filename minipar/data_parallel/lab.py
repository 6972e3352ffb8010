"""The network lab's runs (the NetworkLab widget calls `network_run`): one training method
on real ranks over an emulated network, for SWARM optionally with a worker killed
mid-run.

Averaging methods (the all-reduce, SGP, grouped pairs) run on 4 ranks; SWARM on 5 (a
trainer and two pools of 2). Every rank enters `slow_network` with the chosen latency
and, for one pair, a slower link. Only SWARM takes a kill: it sends the dead worker's
micro-batches through again and goes on, while an all-reduce or a fixed gossip graph
waits for the dead rank forever (they survive by checkpoint and restart instead:
checkpoint.py).
"""

from __future__ import annotations

import torch

from ..collectives import Link, slow_network
from ..models import mlp, regression_data
from ..pipeline.swarm import swarm
from ..runtime import launch
from .gossip import GossipReport, grouped, sgp

METHODS = ("all-reduce", "SGP", "grouped pairs", "SWARM")
BATCH, FEATURES, LR, MICRO = 32, 8, 0.1, 4


def _model() -> torch.nn.Sequential:
    return mlp([FEATURES, 32, 32, 1], seed=0, dtype=torch.float64)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_data(steps * BATCH, FEATURES, seed=1, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _network(latency: float, slow_link: tuple[int, int] | None, slow_latency: float):
    links = {slow_link: Link(slow_latency)} if slow_link else None
    return slow_network(latency=latency, links=links)


def _averaging(method: str, steps: int, latency: float, slow_link,
               slow_latency: float) -> GossipReport:
    train, options = {"all-reduce": (grouped, {"group_size": 4}), "SGP": (sgp, {}),
                      "grouped pairs": (grouped, {"group_size": 2, "swap_every": 2})}[method]
    with _network(latency, slow_link, slow_latency):
        return train(_model(), _batches(steps), _mse, LR, **options)


def _swarm(steps: int, latency: float, slow_link, slow_latency: float, kill: dict | None):
    with _network(latency, slow_link, slow_latency):
        return swarm(_model, [[1, 2], [3, 4]], _batches(steps), _mse, LR, MICRO, kill=kill)


def network_run(method: str, steps: int = 12, latency: float = 0.0,
                slow_link: tuple[int, int] | None = None, slow_latency: float = 0.02,
                kill: int | None = None, kill_step: int = 4) -> dict:
    """Train `method` for `steps` on real ranks; returns {"losses", "seconds" (per step,
    rank 0's or the trainer's view), "ranks", "died": (step, rank) or None}. `kill` (SWARM
    only): the worker rank (1-4) that dies at `kill_step`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if kill is not None and (method != "SWARM" or kill not in range(1, 5)):
        raise ValueError(f"kill must be None, or with method='SWARM' a worker rank from 1 "
                         f"to 4 (an all-reduce or gossip run cannot go on without a rank); "
                         f"got kill={kill!r} with method={method!r}")
    if method == "SWARM":
        # the worker's forwards per step: MICRO micro-batches over a pool of 2
        forwards = None if kill is None else {kill: kill_step * MICRO // 2 + 1}
        run = launch(_swarm, 5, steps, latency, slow_link, slow_latency, forwards,
                     tolerate_deaths=True)
        report = run[0]
        died = report.deaths[0] if report.deaths else None
        return {"losses": report.losses, "seconds": report.seconds, "ranks": 5,
                "died": died}
    report = launch(_averaging, 4, method, steps, latency, slow_link, slow_latency)[0]
    return {"losses": report.losses, "seconds": report.seconds, "ranks": 4, "died": None}
