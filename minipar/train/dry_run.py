"""`minipar train --dry-run`: a configuration's layout at any world size, checked and
built without the hardware, in seconds.

It runs the same `check` and refusals as a real run, then builds the trainer's model part
(`ModelPart`: the decoder cut over the mesh, data parallelism and ZeRO, the optimizer)
exactly as a rank would, with two substitutions:

- **the meta device**: every tensor has its shape and dtype but no storage, so a model
  of any size costs nothing, and nothing is computed (`Decoder.init` leaves meta weights
  unfilled);
- **a fake process group**: torch's `FakeProcessGroup` answers every collective and
  every `new_group` without sending anything, so one process can act as rank r of a
  world of 1,024. It lives in a private module (torch.testing._internal), the way
  torchtitan's and Megatron's dry runs reach it: the import is guarded, and a torch
  without it gets one line.

Every pipeline stage is built once, as the rank at that stage with every other
coordinate 0: the splits are even (tp must divide heads, ep the experts, and ZeRO pads
its shards), so every dp, ep, cp and tp rank of a stage holds the same shapes. Each
rank's groups come from the mesh itself (`Mesh.groups`), and the memory by kind from
the planner's formulas (`memory_report.predicted_memory`), the same ones a real run
prints beside what it measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from ..report import format_table
from ..runtime.device import building_on
from .config import TrainConfig
from .loop import build_part
from .memory_report import predicted_memory
from .model_part import trainer_mesh

GIB, MIB = 2**30, 2**20
SHOWN = 16  # ranks printed in full; the rest go to the file


def _fake_store() -> type:
    try:
        # private: torch's own tests use it, and so do torchtitan's and Megatron's dry runs
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise ValueError(f"--dry-run needs torch's fake process group "
                         f"(torch.testing._internal.distributed.fake_pg), which torch "
                         f"{torch.__version__} lacks; install torch==2.13.0, or leave out "
                         "--dry-run") from None
    return FakeStore


@contextmanager
def acting_as(rank: int, world: int) -> Iterator[None]:
    """Inside the block this process is rank `rank` of `world` over a fake process group,
    building on the meta device, with no cross-rank argument checks (no values come back)."""
    if dist.is_initialized():
        raise ValueError("a dry run starts its own fake process group: run it from the "
                         "command line, not inside minipar.launch or torchrun")
    store = _fake_store()
    dist.init_process_group("fake", store=store(), rank=rank, world_size=world)
    try:
        with building_on(torch.device("meta")), collectives.validation(False):
            yield
    finally:
        dist.destroy_process_group()


def _size(nbytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB: "97.0 GiB", "0.4 MiB"."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _ranks_text(ranks: list[int]) -> str:
    """A group as text: "5", "0-7", "0-56 by 8", or the ranks listed."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:], strict=False)):
        return f"{ranks[0]}-{ranks[-1]}" + (f" by {step}" if step > 1 else "")
    return ",".join(map(str, ranks))


def stage_parts(config: TrainConfig, ranks: int) -> list[dict]:
    """Each pipeline stage's part, built on meta as its first rank: the parameters it holds
    and computes with, and those its optimizer updates (a ZeRO slice, or all of them)."""
    mesh, rows = trainer_mesh(config), []
    for stage in range(config.parallel.pp):
        rank = mesh.rank_at(**{n: stage if n == "pp" else 0 for n in mesh.names})
        with acting_as(rank, ranks):
            held, updated, size = part_counts(build_part(config))
            rows.append({"stage": stage, "built_as": rank, "held": held, "updated": updated,
                         "bytes_per_value": size})
    return rows


def part_counts(part) -> tuple[int, int, int]:
    """(parameters a part holds, parameters its optimizer updates, bytes per value): the
    same on the meta device as on a real rank."""
    held = {id(p): p for _, p in part.named_parameters()}.values()  # a tied weight once
    updated = [p for g in part.optimizer.param_groups for p in g["params"]]
    return (sum(p.numel() for p in held), sum(p.numel() for p in updated),
            next(iter(held)).element_size())


def rank_rows(config: TrainConfig) -> list[dict]:
    """Every rank: its coordinates and its group along each dimension above 1."""
    mesh = trainer_mesh(config)
    dims = [n for n in mesh.names if mesh[n] > 1]
    # each dimension's groups once, indexed by rank (group_of would rescan the mesh per rank)
    member = {n: {r: g for g in mesh.groups(n) for r in g} for n in dims}
    return [{"rank": r, "coords": mesh.coords(r),
             "groups": {n: _ranks_text(member[n][r]) for n in dims}}
            for r in range(mesh.size)]


def dry_run(config: TrainConfig, ranks: int, out: Path | None = None) -> str:
    """The report: the mesh, each stage's parameters, memory per rank by kind, and every
    rank's groups (the first SHOWN here; all of them in OUT/dry_run.txt when `out`)."""
    start = time.perf_counter()
    stages = stage_parts(config, ranks)
    everyone = rank_rows(config)
    seconds = time.perf_counter() - start
    m, mesh = config.model, trainer_mesh(config)
    dims = [n for n in mesh.names if mesh[n] > 1]
    lines = [f"dry run: {ranks} ranks as {mesh}; decoder of {m.layers} layers, hidden "
             f"{m.hidden}, {m.parameters():,} parameters",
             f"built each of the {len(stages)} pipeline stages' parts on the meta device over "
             f"torch's fake process group (nothing allocated, computed or sent) in "
             f"{seconds:.1f} s", "",
             "per stage (every dp, ep, cp and tp rank of a stage holds the same shapes):"]
    lines.append(format_table(
        [{"stage": s["stage"], "as": s["built_as"], "held": f"{s['held']:,}",
          "updated": f"{s['updated']:,}",
          "weights": _size(s["held"] * s["bytes_per_value"])} for s in stages],
        [("stage", "pp stage"), ("as", "built as rank"), ("held", "parameters held"),
         ("updated", "updated by each rank"), ("weights", "its weights")]))
    memory = predicted_memory(config)
    lines += ["", "memory per rank by kind (the planner's formulas, memory_report."
              "predicted_memory; the fullest stage):",
              "  " + ", ".join(f"{k} {_size(v)}" for k, v in memory.items())
              + f"; total {_size(sum(memory.values()))}", ""]
    table = format_table(
        [{"rank": r["rank"], **{n: r["coords"][n] for n in dims},
          **{f"{n} group": r["groups"][n] for n in dims}} for r in everyone],
        [("rank", "rank"), *[(n, n) for n in dims], *[(f"{n} group", f"{n} group") for n in dims]])
    rows = table.splitlines()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_run.txt").write_text("\n".join(lines + [table]) + "\n")
    shown = rows[:2 + SHOWN]
    where = (f" (all {ranks} in {out / 'dry_run.txt'})" if out is not None
             else " (--out DIR writes all of them to DIR/dry_run.txt)")
    title = ("each rank's groups" if len(rows) <= 2 + SHOWN
             else f"each rank's groups, the first {SHOWN}{where}")
    return "\n".join(lines + [title + ":"] + shown)
