"""`minipar bench moe`'s second part: the systems papers' layers on the same tokens.

On 4 ranks: expert parallelism with the flat all-to-all, pipelined in chunks,
hierarchical (as 2 nodes of 2), and with the dropless, expert-choice and LSH-MoE
routings; Tutel's adaptive layer at degree 1 (= EP) and 0 (experts gathered); Pipeline
MoE (the experts inside one tensor-parallel group of 4, every rank holding all tokens).
On one process: capacity-based MoE,
dropless, expert choice and LSH-MoE, with what each would send through a dispatch.
Then the raw exchange, flat vs hierarchical, with the messages that cross nodes
counted."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .. import collectives
from ..mesh import Mesh
from ..report import format_table, progress, spread
from ..runtime import Cluster, device, rank, world_size
from .adaptive import AdaptiveMoE
from .dropless import DroplessMoE
from .exchange import Exchange, FlatAllToAll
from .expert_choice import ExpertChoiceMoE
from .expert_parallel import ExpertParallelMoE
from .hierarchical import HierarchicalAllToAll, hierarchical_all_to_all
from .layer import MoELayer
from .lsh import LSHMoE
from .pipeline_moe import PipelineMoE
from .pipelining import ChunkedAllToAll

SHAPE = dict(hidden=128, ffn=256, experts=8, k=2)


@dataclass(frozen=True)
class System:
    """One row of the systems table, as data: which `parallelism` ("EP", "adaptive", "pipeline"
    or "one process"), which routing `rule` ("top-k", "dropless", "expert choice", "lsh")
    and, for EP, which `exchange` ("flat", "pipelined" with `chunks`, "hierarchical");
    `degree` is the adaptive layer's. The table's name is derived (`label`)."""

    parallelism: str
    rule: str = "top-k"
    exchange: str | None = None
    chunks: int | None = None
    degree: int | None = None

    @property
    def ranks(self) -> int:
        return 1 if self.parallelism == "one process" else 4

    @property
    def label(self) -> str:
        if self.parallelism == "one process":
            return ONE_PROCESS_NAMES[self.rule]
        if self.parallelism == "adaptive":
            return f"Tutel adaptive, r={self.degree} " + (
                "(= EP)" if self.degree == 1 else "(experts gathered)")
        if self.parallelism == "pipeline":
            return "Pipeline MoE (TP group of 4)"
        if self.rule != "top-k":
            return "EP, " + EP_RULE_NAMES[self.rule]
        if self.exchange == "pipelined":
            return f"EP, pipelined ({self.chunks} chunk{'s' if self.chunks > 1 else ''})"
        return {"flat": "EP, flat all-to-all",
                "hierarchical": "EP, hierarchical (2 nodes x 2)"}[self.exchange]


ONE_PROCESS_NAMES = {"top-k": "MoE, capacity 1.25", "dropless": "dropless",
                     "expert choice": "expert choice", "lsh": "LSH-MoE, 4 bits"}
EP_RULE_NAMES = {"dropless": "dropless", "expert choice": "expert choice",
                 "lsh": "LSH-MoE 4 bits"}
TWINS = {"top-k": MoELayer, "dropless": DroplessMoE, "expert choice": ExpertChoiceMoE,
         "lsh": LSHMoE}


def _tokens(total: int, hidden: int) -> torch.Tensor:
    """Tokens that cluster, as real ones do (LSH needs similar tokens to compress)."""
    gen = torch.Generator().manual_seed(0)
    # a CPU generator draws on the host: moved just below
    centres = 2 * torch.randn(32, hidden, generator=gen)
    tokens = centres[torch.randint(0, 32, (total,), generator=gen)] + \
        0.3 * torch.randn(total, hidden, generator=gen)
    return tokens.to(device())


def _layer(rule: str) -> torch.nn.Module:
    """The one-process twin of a routing rule, on SHAPE (LSH-MoE with 4 bits)."""
    extra = {"bits": 4} if rule == "lsh" else {}
    # seeded on the host, then moved: the same layer on any device
    layer = TWINS[rule](SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"], SHAPE["k"],
                        capacity_factor=1.25, **extra)
    return layer.to(device())


def _exchange_of(system: System) -> Exchange:
    """The row's exchange, built from its fields."""
    if system.exchange == "hierarchical":
        groups = Mesh(node=2, local=2).connect()
        return HierarchicalAllToAll(groups.local, groups.node)
    return ChunkedAllToAll(system.chunks) if system.exchange == "pipelined" else FlatAllToAll()


def _step(system: System, tokens: int, steps: int) -> dict:
    """On one rank: median seconds of forward + backward, bytes and messages sent per step,
    the rows the dispatch carried (or would carry) per step and the rows the experts ran
    on. Timed with the collectives' cross-rank handshake off (a debugging aid, not part
    of any layer: on, it adds messages to every all-to-all call, so to some rows more
    than others), after one untimed step."""
    k, me = world_size(), rank()
    x_all = _tokens(tokens, SHAPE["hidden"])
    layer, x = _layer(system.rule), x_all.chunk(k)[me]
    if system.parallelism == "EP":
        layer = ExpertParallelMoE(layer, exchange=_exchange_of(system))
    elif system.parallelism == "adaptive":
        layer = AdaptiveMoE(layer, degree=system.degree)
    elif system.parallelism == "pipeline":
        layer, x = PipelineMoE(layer), x_all  # every rank holds all tokens
    else:
        x = x_all
    times, sent, messages = [], 0, 0
    with collectives.validation(False):
        for step in range(steps + 1):
            if k > 1:
                torch.distributed.barrier()
            with collectives.meter() as m:
                start = time.perf_counter()
                layer(x).pow(2).mean().backward()
                elapsed = time.perf_counter() - start
            if step:
                times.append(elapsed)
                sent += m.sent_bytes
                messages += m.messages
    routing = getattr(layer, "last_routing", None)
    kept, choices = (int(routing.kept.sum()), routing.kept.numel()) if routing else (0, 0)
    rows = _expert_rows(layer)
    return {"seconds": statistics.median(times), "bytes_per_step": sent / steps,
            "messages_per_step": messages / steps, "rows": rows,
            "computed": _computed_rows(layer, rows), "kept": kept, "choices": choices,
            "replicated": isinstance(layer, PipelineMoE)}


def _expert_rows(layer: torch.nn.Module) -> int | None:
    """Rows this rank's experts computed in the last call: the token choices that arrived
    (centroids for LSH-MoE, every choice when dropless, C per expert for expert choice);
    a capacity buffer's empty slots not counted."""
    if isinstance(layer, ExpertParallelMoE):
        return layer.tokens_received
    if isinstance(layer, PipelineMoE | AdaptiveMoE):
        return layer.rows_computed
    if isinstance(layer, DroplessMoE):
        return sum(layer.last_groups)
    if isinstance(layer, LSHMoE):
        return layer.last_rows[1]
    if isinstance(layer, ExpertChoiceMoE):
        return layer.last_picks.numel()
    routing = getattr(layer, "last_routing", None)
    return int(routing.kept.sum()) if routing is not None else None


def _computed_rows(layer: torch.nn.Module, rows: int | None) -> int | None:
    """Rows this rank's experts ran their matmuls on in the last call: a capacity buffer's
    E x capacity slots, empty ones included (expert parallelism with the flat or
    hierarchical exchange, and the one-process capacity layer), else the rows that came."""
    if isinstance(layer, ExpertParallelMoE):
        return layer.rows_computed
    if type(layer) is MoELayer:
        return len(layer.experts) * layer.last_routing.capacity
    return rows


SYSTEMS = (System("EP", exchange="flat"), *(System("EP", exchange="pipelined", chunks=c)
                                             for c in (1, 2, 4)),
           *(System("EP", rule, exchange="flat") for rule in EP_RULE_NAMES),
           System("EP", exchange="hierarchical"), System("adaptive", degree=1),
           System("adaptive", degree=0), System("pipeline"),
           *(System("one process", rule) for rule in ONE_PROCESS_NAMES))


def measure_systems(tokens: int = 2048, steps: int = 3, rounds: int = 3) -> list[dict]:
    """Tokens/s, bytes and messages sent per step, dispatch rows and computed rows of every
    layer on the same tokens. The layers take turns for `rounds` rounds, each round
    starting one layer further down the list (so no layer always runs first on freshly
    started ranks); "vs flat EP" is the median of per-round ratios with their spread."""
    seconds: dict[System, list[float]] = {system: [] for system in SYSTEMS}
    last: dict[System, list[dict]] = {}
    with Cluster(1, backend="gloo") as one, Cluster(4, backend="gloo") as four:
        for round_index in range(rounds):
            shift = round_index * len(SYSTEMS) // max(rounds, 1)
            for system in SYSTEMS[shift:] + SYSTEMS[:shift]:
                progress(f"round {round_index + 1}/{rounds}: {system.label}")
                run = (one if system.ranks == 1 else four).run(_step, system, tokens, steps)
                seconds[system].append(max(r["seconds"] for r in run))
                last[system] = run
    rows = []
    for system in SYSTEMS:
        run = last[system]
        routed = run[:1] if run[0]["replicated"] else run  # the same routing everywhere
        kept, choices = (sum(r[key] for r in routed) for key in ("kept", "choices"))
        rows.append({"system": system.label, "parallelism": system.parallelism, "rule": system.rule,
                     "exchange": system.exchange, "chunks": system.chunks,
                     "degree": system.degree, "ranks": len(run),
                     "tokens_per_s": tokens / statistics.median(seconds[system]),
                     "vs_flat_ep": [flat / mine for flat, mine in
                                    zip(seconds[SYSTEMS[0]], seconds[system], strict=True)],
                     "bytes_per_step": sum(r["bytes_per_step"] for r in run),
                     "messages_per_step": sum(r["messages_per_step"] for r in run),
                     "dispatch_rows": sum(r["rows"] for r in run),
                     "computed_rows": sum(r["computed"] for r in run),
                     "drop": 1 - kept / choices if choices else 0.0})
    return rows


def _exchange(rows_per_peer: int, repeats: int) -> dict:
    """On one of 4 ranks (2 nodes x 2): the flat and the hierarchical all-to-all of the same
    rows; median seconds, and messages this rank sent across nodes."""
    groups = Mesh(node=2, local=2).connect()
    me, k = rank(), world_size()
    x = torch.randn(rows_per_peer * k, 64, device=device())
    counts = [rows_per_peer] * k
    out = {}
    for kind in ("flat", "hierarchical"):
        times, across = [], 0
        for _ in range(repeats):
            torch.distributed.barrier()
            with collectives.meter() as m:
                start = time.perf_counter()
                if kind == "flat":
                    collectives.all_to_all(x, counts, counts)
                    across = sum(1 for t in m.transfers if t.direction == "send"
                                 and t.peer // 2 != me // 2)
                else:
                    meters: dict = {}
                    hierarchical_all_to_all(x, counts, groups.local, groups.node, meters)
                    across = meters["across"].messages
                times.append(time.perf_counter() - start)
        out[kind] = (statistics.median(times), across)
    return out


def measure_exchange(sizes: tuple[int, ...] = (1, 64, 4096), repeats: int = 5) -> list[dict]:
    """Flat vs hierarchical all-to-all on 4 ranks as 2 nodes x 2, per rows sent to each
    peer (64 floats a row): time, and messages crossing nodes per rank."""
    rows = []
    with Cluster(4, backend="gloo") as four:
        for n in sizes:
            progress(f"exchange, {n} rows per peer")
            result = four.run(_exchange, n, repeats)
            for kind in ("flat", "hierarchical"):
                rows.append({"exchange": kind, "rows_per_peer": n,
                             "bytes_per_peer": n * 64 * 4,
                             "seconds": max(r[kind][0] for r in result),
                             "messages_across_nodes": result[0][kind][1]})
    return rows


def report_systems(rows: list[dict], exchange: list[dict]) -> str:
    """The two tables."""
    shown = [{"system": r["system"], "ranks": r["ranks"], "tps": f"{r['tokens_per_s']:.0f}",
              "vs": spread(r["vs_flat_ep"]), "bytes": f"{r['bytes_per_step']:,.0f}",
              "msgs": f"{r['messages_per_step']:.0f}",
              "rows": "-" if r["dispatch_rows"] is None else str(r["dispatch_rows"]),
              "computed": "-" if r["computed_rows"] is None else str(r["computed_rows"]),
              "drop": f"{r['drop']:.0%}"} for r in rows]
    first = format_table(shown, [("system", "layer"), ("ranks", "ranks"),
                                 ("tps", "tokens/s"), ("vs", "vs flat EP (min-max)"),
                                 ("bytes", "bytes sent per step (all ranks)"),
                                 ("msgs", "messages per step"),
                                 ("rows", "expert rows (all ranks)"),
                                 ("computed", "rows computed"),
                                 ("drop", "choices dropped")])
    shown = [{"kind": r["exchange"], "n": r["rows_per_peer"],
              "b": f"{r['bytes_per_peer']:,}", "t": f"{r['seconds'] * 1e3:.2f} ms",
              "m": r["messages_across_nodes"]} for r in exchange]
    second = format_table(shown, [("kind", "all-to-all"), ("n", "rows per peer"),
                                  ("b", "bytes per peer"), ("t", "time (slowest rank)"),
                                  ("m", "messages across nodes, per rank")])
    return (f"MoE layers on the same {SHAPE} tokens (forward + backward), taking turns; "
            "tokens/s from the median round, vs flat EP per round\n" + first
            + "\n\nthe exchange alone, 4 ranks as 2 nodes x 2\n" + second)
