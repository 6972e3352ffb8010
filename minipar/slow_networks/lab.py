"""The network lab's runs (the NetworkLab widget calls `network_run`): one training method
on real ranks over an emulated network, optionally with a worker killed mid-run.

Averaging methods (the all-reduce, SGP, grouped pairs) run on 4 ranks; SWARM on 5 (a
trainer and two pools of 2). Every rank enters `slow_network` with the chosen latency
and, for one pair, a slower link. A killed worker dies by SIGKILL on reaching the kill
step. SGP and grouped pairs go on without it (`survive`: a dead peer's share stays home,
a pair's survivor averages with no one), and SWARM sends its micro-batches through
again; the all-reduce cannot: every step needs every rank, so it takes no kill (it
survives by checkpoint and restart instead: checkpoint_restart.py).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from ..collectives import Link, slow_network
from ..models import mse
from ..pipeline.swarm import swarm
from ..runtime import RankDied, launch, rank
from .elastic import batches, model
from .gossip import GossipReport, grouped, sgp

METHODS = ("all-reduce", "SGP", "grouped pairs", "SWARM")
LR, MICRO = 0.1, 4


class _DiesAt(Sequence):
    """The batches, except that rank `victim` dies (SIGKILL) on reaching step `step`."""

    def __init__(self, batches: list, victim: int | None, step: int) -> None:
        self.batches, self.victim, self.step = batches, victim, step

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        # the death comes when the training loop asks for that step's batch: mid-run, unannounced
        if index == self.step and rank() == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.batches[index]


def _network(latency: float, slow_link: tuple[int, int] | None, slow_latency: float):
    links = {slow_link: Link(slow_latency)} if slow_link else None
    return slow_network(latency=latency, links=links)


def _averaging(method: str, steps: int, latency: float, slow_link, slow_latency: float,
               victim: int | None, kill_step: int) -> GossipReport:
    train, options = {"all-reduce": (grouped, {"group_size": 4}), "SGP": (sgp, {}),
                      "grouped pairs": (grouped, {"group_size": 2, "swap_every": 2})}[method]
    dying = _DiesAt(batches(steps), victim, kill_step)
    with _network(latency, slow_link, slow_latency):
        # measure=False: the consensus distance is a global all-reduce a dead rank would block
        return train(model(), dying, mse, LR, survive=victim is not None, measure=False,
                     **options)


def _swarm(steps: int, latency: float, slow_link, slow_latency: float, kill: dict | None):
    with _network(latency, slow_link, slow_latency):
        return swarm(model, [[1, 2], [3, 4]], batches(steps), mse, LR, MICRO,
                     kill_at_step=kill)


def network_run(method: str, steps: int = 12, latency: float = 0.0,
                slow_link: tuple[int, int] | None = None, slow_latency: float = 0.02,
                kill: int | None = None, kill_step: int = 4) -> dict:
    """Train `method` for `steps` on real ranks; returns {"losses", "seconds" (per step,
    rank 0's or the trainer's view), "ranks", "died": (step, rank) or None}. `kill`: the
    rank (1-4) that dies at `kill_step` (not with the all-reduce)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if kill is not None and (method == "all-reduce" or kill not in range(1, 5)):
        raise ValueError(f"kill must be None, or a rank from 1 to 4 with a method other than "
                         f"'all-reduce' (every all-reduce step needs every rank); got "
                         f"kill={kill!r} with method={method!r}")
    if method == "SWARM":
        # by step: a worker's share of the forwards follows its measured speed (the load)
        run = launch(_swarm, 5, steps, latency, slow_link, slow_latency,
                     None if kill is None else {kill: kill_step}, tolerate_deaths=True)
        report = run[0]
        died = report.deaths[0] if report.deaths else None
        return {"losses": report.losses, "seconds": report.seconds, "ranks": 5,
                "died": died}
    run = launch(_averaging, 4, method, steps, latency, slow_link, slow_latency, kill,
                 kill_step, tolerate_deaths=True)
    report = run[0]  # rank 0 is never killed
    died = next(((kill_step, r.rank) for r in run if isinstance(r, RankDied)), None)
    return {"losses": report.losses, "seconds": report.seconds, "ranks": 4, "died": died}
