"""Surviving a dead worker: checkpoint and resume data parallelism.

Every `every` steps each rank writes its own state (model, optimizer, steps done, the
world size it trained on) to `dir/step-N/rank-R.pt`, under a temporary name renamed
when whole, so a file is complete or absent. After a barrier rank 0 writes
`dir/latest` naming N: a checkpoint counts only once every rank has written it, and a
rank that dies mid-write leaves the previous one in force.

A run that starts reads `latest` and resumes there, on however many ranks it now has.
Data-parallel state is the same on every rank, so any rank's file serves: each reads
its own if it has one, else rank 0's. The global batch is re-sharded over the new
world size, each rank's loss scaled by `shard_weight` as everywhere in the package, so
the averaged gradient is the whole batch's whatever K is and a resumed run equals an
uninterrupted one (tested, momentum buffers included, shards that do not divide).
Under torchrun with `--max-restarts` the same code is the elastic path: the restarted
workers find the checkpoint and go on (`python -m minipar.slow_networks.elastic`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from ..data_parallel import DataParallel, shard, shard_weight
from ..runtime import rank, world_size
from ..trace import record


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)`, then rename the partial file to `path`: atomic, so the file is
    whole or absent, never half-written."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    partial.rename(path)


def commit(directory: str | Path, steps_done: int) -> None:
    """After every rank has written its files for `steps_done` (a barrier), rank 0 marks
    them the latest: a checkpoint counts only once it is complete on every rank."""
    if world_size() > 1:
        dist.barrier()
    if rank() == 0:
        # a reader never sees a half-written "latest" either
        write_whole(Path(directory) / "latest", lambda f: f.write_text(str(steps_done)))


def save_checkpoint(directory: str | Path, steps_done: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> Path:
    """Every rank writes its state for `steps_done`; rank 0 then marks it the latest."""
    folder = Path(directory) / f"step-{steps_done}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank()}.pt"
    write_whole(path, lambda f: torch.save(
        {"steps_done": steps_done, "world_size": world_size(), "model": model.state_dict(),
         "optimizer": optimizer.state_dict()}, f))
    commit(directory, steps_done)
    return path


def latest_step(directory: str | Path) -> int:
    """Steps done at the latest complete checkpoint (0 when there is none)."""
    marker = Path(directory) / "latest"
    return int(marker.read_text()) if marker.exists() else 0


def load_checkpoint(directory: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> int:
    """Restore the latest complete checkpoint into model and optimizer (this rank's file,
    or rank 0's when this rank did not exist then); return its steps done, 0 if none."""
    steps = latest_step(directory)
    if steps == 0:
        return 0
    folder = Path(directory) / f"step-{steps}"
    mine = folder / f"rank-{rank()}.pt"
    # weights_only: load tensors and plain containers only, never unpickle arbitrary code;
    # map_location: read onto the host (rank 0's file holds tensors saved on GPU 0, which
    # is not this rank's); load_state_dict copies them into this rank's parameters
    state = torch.load(mine if mine.exists() else folder / "rank-0.pt", weights_only=True,
                       map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["steps_done"]


def train_resumable(model_fn: Callable[[], nn.Module],
                    batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                    lr: float, directory: str | Path, every: int = 2, momentum: float = 0.9,
                    kill_at: tuple[int, int] | None = None,
                    load: Callable = load_checkpoint) -> tuple[list[float], torch.Tensor]:
    """Data-parallel SGD with momentum that resumes from `directory` (by `load(directory,
    model, optimizer) -> steps done`; lesson 10's exercise passes the learner's) and
    checkpoints every `every` steps. `kill_at=(rank, step)`: that rank dies by SIGKILL
    when it reaches that step (a real death: no exception, no cleanup). Returns this
    run's losses and the final parameters."""
    if every < 1:
        raise ValueError(f"every must be >= 1 (steps between checkpoints); got {every}")
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    start = load(directory, model, optimizer)
    # lesson 02's DDP, after the load: every rank resumed from the same files
    replicated = DataParallel(model)
    losses = []
    for step in range(start, len(batches)):
        if kill_at == (rank(), step):
            # SIGKILL, not an exception: no finally block, no atexit, no half-polite shutdown
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[step]
        with record("compute", "step", step=step):
            optimizer.zero_grad()
            lx, ly = shard(x), shard(y)
            loss = loss_fn(replicated(lx), ly)
            # every sample counts once; backward leaves the averaged gradient in .grad, which
            # the momentum buffer must see
            (loss * shard_weight(len(lx), len(x))).backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % every == 0:
            save_checkpoint(directory, step + 1, model, optimizer)
    with torch.no_grad():
        return losses, parameters_to_vector(model.parameters()).detach().clone()
