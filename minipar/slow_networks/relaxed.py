"""Relaxed synchronization: communicate less often, or without waiting, or without locks.

- `local_sgd`: every rank takes H SGD steps on its own shard, then the ranks
  average their parameters (one all-reduce per H steps instead of per step).
  With H = 1 and plain SGD this is exactly synchronous data parallelism.
- `co2_local_sgd` (after CO2, Sun et al. 2024): the same, but round r's average
  runs on a communication thread while round r+1's local steps compute. When it
  lands, the rank keeps its local progress since the snapshot and rebases it on the
  average: params = average(snapshot_r) + (params - snapshot_r). The average a rank
  uses is therefore one round stale, the price of hiding the communication.
- `hogwild`: ranks share one parameter tensor in memory (a file mapped by every
  process) and apply their SGD updates to it without locks, as in Hogwild! (Niu et
  al. 2011): updates can interleave and overwrite each other, and training still
  converges when updates are sparse or small.

Local SGD and CO2 drive a `LocalReplica` (their extension point): a copy of the model
that takes a local step and whose parameters travel as one flat vector. `SGDReplica` is a
module in memory with plain SGD; ATOM's peer (`atom.SwappedReplica`) is a whole model
swapped layer by layer through a device that cannot hold it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .. import collectives
from ..data_parallel import shard
from ..runtime import rank
from ..trace import record


@dataclass
class RelaxedReport:
    """Per-step local losses and how many averaging rounds ran."""

    losses: list[float] = field(default_factory=list)
    rounds: int = 0


def _check_h(local_steps: int) -> None:
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1 (SGD steps between averages); "
                         f"got {local_steps!r}")


def _local_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                lr: float, step: int) -> float:
    with record("compute", "local step", step=step):
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    # in place under no_grad: p stays the same leaf (for hogwild, the shared view)
                    p -= lr * p.grad
    return loss.item()


class LocalReplica(Protocol):
    """One rank's copy of the model, as local SGD and CO2 see it."""

    def local_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """One optimizer step on this rank's samples (x, y); returns the loss."""

    def vector(self) -> torch.Tensor:
        """The parameters as one flat vector (a copy the caller may keep)."""

    def load_vector(self, flat: torch.Tensor) -> None:
        """Set the parameters from a flat vector."""


class ModuleReplica:
    """A replica whose parameters are a module's in memory (`self.model`): the flat vector
    is theirs, in `model.parameters()` order."""

    model: nn.Module

    def vector(self) -> torch.Tensor:
        with torch.no_grad():
            return parameters_to_vector(self.model.parameters()).clone()

    def load_vector(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(flat, self.model.parameters())


class SGDReplica(ModuleReplica):
    """A module in memory, trained with plain SGD (`p -= lr * grad`)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, lr: float) -> None:
        self.model, self.loss_fn, self.lr = model, loss_fn, lr

    def local_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        return _local_step(self.model, x, y, self.loss_fn, self.lr, step)


def _average(flat: torch.Tensor) -> torch.Tensor:
    with record("all_reduce", "average parameters"):
        return collectives.all_reduce(flat, op="avg")


def local_sgd(replica: LocalReplica, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
              local_steps: int) -> RelaxedReport:
    """H = local_steps steps on this rank's shard of each batch, then average parameters."""
    _check_h(local_steps)
    report = RelaxedReport()
    for step, (x, y) in enumerate(batches):
        report.losses.append(replica.local_step(shard(x), shard(y), step))
        if (step + 1) % local_steps == 0 or step == len(batches) - 1:
            replica.load_vector(_average(replica.vector()))
            report.rounds += 1
    return report


def co2_local_sgd(replica: LocalReplica,
                  batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  local_steps: int) -> RelaxedReport:
    """Local SGD whose averages run while the next round computes (one round stale)."""
    _check_h(local_steps)
    report = RelaxedReport()
    pending: tuple[threading.Thread, torch.Tensor, torch.Tensor] | None = None

    def land() -> None:
        thread, snapshot, averaged = pending
        thread.join()
        # CO2's rebase: the one-round-stale average plus this round's local progress
        replica.load_vector(averaged + (replica.vector() - snapshot))
        report.rounds += 1

    for step, (x, y) in enumerate(batches):
        report.losses.append(replica.local_step(shard(x), shard(y), step))
        if (step + 1) % local_steps == 0 or step == len(batches) - 1:
            if pending is not None:
                land()  # last round's average, computed while this round ran
            snapshot = replica.vector()
            # the thread averages `averaged` in place; `snapshot` stays as it is, for the rebase
            averaged = snapshot.clone()
            # daemon: a hung average never blocks the rank's exit
            thread = threading.Thread(target=_average, args=(averaged,), daemon=True)
            thread.start()
            pending = (thread, snapshot, averaged)
    if pending is not None:
        land()
    return report


def hogwild(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
            loss_fn: Callable, lr: float, shared_file: str) -> RelaxedReport:
    """Lock-free SGD on parameters every rank maps from `shared_file` (rank 0 writes the
    start values into it; the others wait at a barrier). Each rank trains on its own
    shard of every batch and writes straight into the shared tensor. The pages shared are
    the host's: on a GPU the parameters and batches move to the host, where every process
    maps the same memory (device memory is each process's own)."""
    params = list(model.cpu().parameters())  # host pages are what processes can share
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError("hogwild shares float32 memory: build the model in float32")
    count = sum(p.numel() for p in params)
    if rank() == 0:
        with torch.no_grad():
            start = parameters_to_vector(params).to(torch.float32).contiguous()
        # raw float32 bytes, no header: torch.from_file below reads them back as they are
        start.cpu().numpy().tofile(shared_file)
    # the file exists and holds the start values before anyone maps it
    dist.barrier()
    # shared=True: a MAP_SHARED mapping, so every process's writes land in the same pages
    shared = torch.from_file(shared_file, shared=True, size=count, dtype=torch.float32)
    offset = 0
    for p in params:  # every parameter becomes a view of the shared memory
        p.data = shared[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    report = RelaxedReport()
    for step, (x, y) in enumerate(batches):
        x, y = shard(x).cpu(), shard(y).cpu()
        report.losses.append(_local_step(model, x, y, loss_fn, lr, step))
    # every rank's updates are in before anyone reads the final parameters
    dist.barrier()
    return report


def train_relaxed(method: str, model_fn: Callable[[], nn.Module], batches: Sequence,
                  loss_fn: Callable, lr: float, local_steps: int = 4,
                  shared_file: str | None = None) -> tuple[RelaxedReport, torch.Tensor]:
    """Run one method by name on this rank; return its report and final parameters."""
    model = model_fn()
    if method == "local_sgd":
        report = local_sgd(SGDReplica(model, loss_fn, lr), batches, local_steps)
    elif method == "co2":
        report = co2_local_sgd(SGDReplica(model, loss_fn, lr), batches, local_steps)
    elif method == "hogwild":
        if shared_file is None:
            raise ValueError("hogwild needs shared_file: a path every rank can map")
        report = hogwild(model, batches, loss_fn, lr, shared_file)
    else:
        raise ValueError(f"method must be one of 'local_sgd', 'co2', 'hogwild'; got {method!r}")
    with torch.no_grad():
        return report, parameters_to_vector(model.parameters()).detach().clone()

