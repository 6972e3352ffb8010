"""The NCCL rehearsal: minipar's own messages, logged on gloo ranks, replayed under NCCL's
rules (collectives/message_log.py records, collectives/nccl_replay.py replays).

Every case runs its real code on CPU ranks with the log on (on the faked device too,
under MINIPAR_FAKED_DEVICE=1, as the tests run it), then replays the logs in
both of the replay's modes: "lazy" (communicators made at first use, as
`init_process_group` without `device_id` leaves them) and "eager" (with `device_id`,
as minipar starts NCCL ranks). A row says whether each would complete, and if not,
the pattern and the lines. `python -m minipar.nccl_rehearsal` prints the table
(`--case ring` picks cases by name); tests/test_nccl_rehearsal.py holds every case to
"completes" in both modes.

Not replayed, gloo-only by nature: `recv_any` (NCCL has no receive from any rank),
so SkipPipe's and SWARM's routing and gossip's; and what waits on a dead peer
(`tolerate_deaths`, fault tolerance), which reads gloo's errors. Each refuses NCCL in
one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import collectives as C
from .collectives.message_log import Entry, recording
from .collectives.nccl_replay import Outcome, replay
from .runtime import device, rank, world_size

SCHEDULE_VIRTUAL = {"interleaved_1f1b": 2, "looped_bfs": 2, "zb_v": 2, "dualpipev": 2}


@dataclass(frozen=True)
class Case:
    """One rehearsal: `task(*args)` on `ranks` gloo ranks, every rank logged."""

    name: str
    ranks: int
    task: Callable
    args: tuple = ()
    slow: bool = False  # the test suite's slow tier runs it


@dataclass
class RehearsalRow:
    case: str
    ranks: int
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        return all(o.completes for o in self.outcomes)


def recorded(task: Callable, *args) -> list[Entry]:
    """Run `task(*args)` on this rank with the message log on; return its entries."""
    with recording() as log:
        task(*args)
    return log.entries


# ---------------------------------------------------------------------- the cases ---

def every_collective() -> None:
    """Each of minipar's collectives once, on uneven sizes, on this run's ranks."""
    k, me = world_size(), rank()
    x = torch.arange(10, dtype=torch.float64, device=device()) + me
    for algorithm in C.ALL_REDUCE_ALGORITHMS:
        C.all_reduce(x.clone(), algorithm=algorithm)
    for algorithm in C.ROOTED_ALGORITHMS:
        C.broadcast(x.clone(), src=k - 1, algorithm=algorithm)
        C.reduce(x.clone(), dst=k - 1, algorithm=algorithm)
    C.scatter(torch.arange(3 * k, dtype=torch.float64, device=device()), src=0)
    C.gather(x, dst=k - 1)
    C.all_gather(x)
    C.reduce_scatter(torch.ones(3 * k, dtype=torch.float64, device=device()))
    C.pipelined_ring_all_reduce(x.clone())
    # uneven, with empty pieces: rank r sends r rows to each higher rank, none below
    send = [me if peer > me else 0 for peer in range(k)]
    recv = C.swap_counts(send)
    C.all_to_all(torch.ones(sum(send), 2, device=device()), send, recv)


def trainer(parallel: dict, model: dict | None = None, train_: dict | None = None) -> None:
    """Two steps of a small decoder on this parallel layout, with an evaluation between
    them and the trainer's memory step after: every message a run sends."""
    from .train.config import load_config
    from .train.loop import train

    overrides = {"train.steps": 2, "train.eval_every": 1, "train.eval_batches": 1,
                 "train.batch_size": 16, "model.seq_len": 16, "model.hidden": 32,
                 "optim.warmup_steps": 1}
    overrides.update({f"parallel.{k}": v for k, v in parallel.items()})
    overrides.update({f"model.{k}": v for k, v in (model or {}).items()})
    overrides.update({f"train.{k}": v for k, v in (train_ or {}).items()})
    train(load_config("tiny", overrides))


def ring_and_ulysses(kind: str) -> None:
    """Causal attention over this run's ranks, forward and backward, balanced."""
    from .context_parallel import ring_attention, ulysses_attention

    k = world_size()
    gen = torch.Generator().manual_seed(rank())
    q, kk, v = (torch.randn(1, 2 * k, 4, 8, generator=gen, dtype=torch.float64)
                .to(device()).requires_grad_() for _ in range(3))
    attend = ring_attention if kind == "ring" else ulysses_attention
    attend(q, kk, v, causal=True, balanced=True).sum().backward()


def tp_overlap() -> None:
    """The tp overlap's collective matmuls, forward."""
    from .tensor_parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter

    x = torch.ones(1, 4, 6, dtype=torch.float64, device=device())
    w = torch.ones(6, 6, dtype=torch.float64, device=device())
    all_gather_matmul(x, w)
    matmul_reduce_scatter(torch.ones(1, 4 * world_size(), 6, dtype=torch.float64,
                                     device=device()), w)


def moe_exchange() -> None:
    """MoE pipelining: the non-blocking exchange, and the chunked dispatch and combine."""
    from .moe.pipelining import pipelined_experts, start_exchange

    k, me = world_size(), rank()
    send = [1 + (me + p) % 2 for p in range(k)]
    recv = C.swap_counts(send)
    rows = torch.ones(sum(send), 3, device=device())
    _, pending = start_exchange(rows, send, recv)
    for p in pending:
        p.wait()
    meta = torch.zeros(sum(recv), dtype=torch.int64, device=device())
    pipelined_experts(rows, meta, send, recv, lambda arrived, _: arrived * 2, chunks=2)


def resharded() -> None:
    """A tensor split over ranks [0, 1] moved to a split over ranks [1, 2]."""
    from .mesh.reshard import reshard

    local = torch.ones(3, 2, device=device()) if rank() in (0, 1) else None
    reshard(local, (6, 2), [0, 1], "S(0)", [1, 2], "S(0)")


def _schedule_cases(pp: int) -> list[Case]:
    from .train.loop import SYNCHRONOUS

    cases = []
    for name in SYNCHRONOUS:
        virtual = SCHEDULE_VIRTUAL.get(name, 1)
        parallel = {"pp": pp, "schedule": name, "virtual": virtual,
                    "microbatches": 1 if name == "naive" else pp * virtual}
        # a layer per virtual stage, untied when the two ends' copies would share a rank
        model = {"layers": pp * virtual, "tied": virtual == 1}
        slow = pp > 2 and name not in ("1f1b", "zb_v")
        cases.append(Case(f"trainer pp{pp} {name}", pp, trainer, (parallel, model), slow))
    return cases


def cases() -> list[Case]:
    """Every rehearsal, in the order the table lists them."""
    out = [Case(f"every collective, K={k}", k, every_collective, slow=k > 3)
           for k in (2, 3, 4, 8)]
    out += _schedule_cases(2) + _schedule_cases(4)
    out += [Case("trainer cp2 ring", 2, trainer, ({"cp": 2},)),
            Case("trainer cp2 ulysses", 2, trainer, ({"cp": 2, "cp_kind": "ulysses"},)),
            Case("trainer dp2 x cp2", 4, trainer, ({"dp": 2, "cp": 2},)),
            Case("trainer tp2 sp", 2, trainer, ({"tp": 2, "sequence_parallel": True},)),
            Case("trainer ep2 (experts)", 2, trainer, ({"dp": 2, "ep": 2}, {"experts": 2})),
            Case("tp overlap, 2 ranks", 2, tp_overlap),
            Case("ring attention, 3 ranks", 3, ring_and_ulysses, ("ring",)),
            Case("ulysses attention, 3 ranks", 3, ring_and_ulysses, ("ulysses",)),
            Case("tp overlap, 3 ranks", 3, tp_overlap),
            Case("MoE exchange and chunked all-to-all, 3 ranks", 3, moe_exchange),
            Case("reshard [0,1] -> [1,2]", 3, resharded)]
    return out


def rehearse(selected: Sequence[Case], cluster: Callable[[int], object]) -> list[RehearsalRow]:
    """Run each case on `cluster(ranks)` (a minipar.Cluster) and replay it both ways."""
    rows = []
    for case in selected:
        logs = list(cluster(case.ranks).run(recorded, case.task, *case.args))
        outcomes = [replay(logs, m) for m in ("lazy", "eager")]
        rows.append(RehearsalRow(case.name, case.ranks, outcomes))
    return rows


def table(rows: Sequence[RehearsalRow]) -> str:
    """The rows as a markdown table: case, ranks, and each mode's outcome."""
    lines = ["| case | ranks | lazy (no device_id) | eager (device_id) |",
             "|---|---|---|---|"]
    for row in rows:
        cells = [o.pattern + (f" ({o.mismatched} on different communicators)"
                              if o.mismatched else "") for o in row.outcomes]
        lines.append(f"| {row.case} | {row.ranks} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import minipar

    parser = argparse.ArgumentParser(prog="python -m minipar.nccl_rehearsal",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    chosen = [c for c in cases() if args.case in c.name]
    if not chosen:
        names = "; ".join(c.name for c in cases())
        print(f"no case's name contains {args.case!r}; the cases: {names}", file=sys.stderr)
        return 2
    clusters: dict[int, minipar.Cluster] = {}

    def cluster(k: int) -> minipar.Cluster:
        if k not in clusters:
            clusters[k] = minipar.Cluster(k, backend="gloo", timeout=120)
        return clusters[k]

    try:
        rows = rehearse(chosen, cluster)
    finally:
        for c in clusters.values():
            c.close()
    print(table(rows))
    for row in rows:
        for outcome in row.outcomes:
            if not outcome.completes:
                print(f"\n{row.case}, {outcome}")
    return 0 if all(r.completes for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
