"""`minipar bench cluster`: two nodes of two ranks on this one machine, the link between
the nodes slowed (`slow_network(per_node=2, across=ACROSS)`: ranks 0-1 are one node, 2-3
the other; inside a node, plain loopback). The two choices a node boundary asks for,
each pair measured in turns (a round runs both; ratios per round) beside the cost
model's prediction on the same emulated cluster, and the traffic the network counted
crossing the nodes:

- MoE's all-to-all: flat (every rank sends K - per_node messages across) against Tutel's
  hierarchical one (one aggregated message across, per remote node);
- a decoder training step laid out dp=2 x tp=2: tp inside the nodes (the planner's layout,
  Megatron's order: only dp's gradient all-reduce crosses, once per step) against tp
  across them (tp's 4 all-reduces per layer and micro-batch cross).

The prediction's constants: alpha and beta from a ping-pong on loopback, ACROSS's added
on the links between nodes, compute and memory rates timed on one rank
(`mesh.bench`'s). On a real cluster the slow link is the NIC between machines; here a
sleep before each message stands for it, so the ordering, not the absolute time, is what
carries over."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from matplotlib.figure import Figure

from ..collectives import Link, all_to_all, fit_machine, slow_network
from ..cost import TransformerConfig
from ..mesh.bench import BATCH, MICROBATCHES, SHAPE, compute_rates, this_machine, time_steps
from ..mesh.planner import MEGATRON_ORDER, Layout, estimate
from ..moe.hierarchical import all_to_all_time, hierarchical_all_to_all, node_mesh
from ..report import format_table, progress, ratio_cell, save_results, spread
from ..runtime import Cluster, device, rank, world_size

ACROSS = Link(latency=2e-3, bandwidth=100e6)  # between the nodes: 2 ms, 100 MB/s
PER_NODE, ROW_FLOATS = 2, 64
# dp=2 x tp=2 on 4 ranks, numbered in mesh order: tp last keeps each tp pair in a node
LAYOUTS = {"tp inside, dp across": dict(pp=1, dp=2, tp=2),
           "tp across, dp inside": dict(pp=1, tp=2, dp=2)}
ORDERS = {"tp inside, dp across": MEGATRON_ORDER, "tp across, dp inside": ("pp", "tp", "dp")}


def _traffic(network) -> dict[str, float]:
    """What the network counted across nodes: messages, bytes, and "charged" seconds."""
    return {"messages": network.traffic["messages across"],
            "bytes": network.traffic["bytes across"],
            "charged": network.traffic["seconds across"]}


def exchanges(rows_per_peer: int, rounds: int, across: Link = ACROSS) -> list[dict]:
    """On every rank of 4 (2 nodes x 2), `rounds` rounds of the flat and the hierarchical
    all-to-all of the same rows (which goes first alternates) on the emulated cluster: per
    round and kind, the seconds it took and what this rank sent across nodes (`_traffic`)."""
    groups = node_mesh(PER_NODE).connect()
    k = world_size()
    # a CPU generator draws on the host: moved just below
    x = torch.randn(rows_per_peer * k, ROW_FLOATS,
                    generator=torch.Generator().manual_seed(rank())).to(device())
    counts = [rows_per_peer] * k
    out = []
    for i in range(rounds):
        found = {}
        for kind in ("flat", "hierarchical")[::1 if i % 2 == 0 else -1]:
            torch.distributed.barrier()
            with slow_network(per_node=PER_NODE, across=across) as network:
                start = time.perf_counter()
                if kind == "flat":
                    all_to_all(x, counts, counts)
                else:  # every rank's counts are known (all equal), as the flat one's are
                    hierarchical_all_to_all(x, counts, groups.local, groups.node,
                                            counts=[counts] * k)
                found[kind] = {"seconds": time.perf_counter() - start, **_traffic(network)}
        out.append(found)
    return out


def layout_steps(dims: dict[str, int], steps: int, across: Link = ACROSS) -> dict:
    """`mesh.bench.time_steps` (the mesh bench's decoder, one warm-up step) on the emulated
    cluster: this rank's seconds per step and its traffic across nodes per step (a free
    `across` link only counts it). Building the model is not counted: its first
    broadcast of the weights is not a step's traffic."""
    networks = []

    @contextmanager
    def network() -> Iterator[None]:
        with slow_network(per_node=PER_NODE, across=across) as emulated:
            networks.append(emulated)
            yield

    times = time_steps(dims, steps, network)
    return {"times": times, **{k: v / (steps + 1) for k, v in _traffic(networks[0]).items()}}


def _rates():
    """The compute and memory rates, timed on rank 0 while the others wait."""
    found = compute_rates() if rank() == 0 else None
    torch.distributed.barrier()
    return found


def measure(sizes: tuple[int, ...] = (1, 256, 4096), latencies: tuple[float, ...] = (2e-3, 20e-3),
            rounds: int = 3, steps: int = 2) -> list[dict]:
    """The all-to-alls for every size and latency between the nodes (ACROSS's bandwidth),
    then the decoder step's two layouts on ACROSS."""
    rows = []
    with Cluster(4, backend="gloo", timeout=300) as ranks:
        progress("fitting alpha and beta (ping-pong) and the compute rates")
        fitted = fit_machine(ranks, save=False)
        alpha, beta = fitted.alpha, fitted.beta
        flops, bandwidth = ranks.run(_rates)[0]
        for latency, n in itertools.product(latencies, sizes):
            progress(f"all-to-all, {n} rows per peer, {latency * 1e3:g} ms, {rounds} rounds")
            link = Link(latency, ACROSS.bandwidth)
            per_rank = ranks.run(exchanges, n, rounds, link)
            nbytes = n * ROW_FLOATS * 4 * len(per_rank)  # what one rank sends in all
            flat = [max(r[i]["flat"]["seconds"] for r in per_rank) for i in range(rounds)]
            for kind in ("flat", "hierarchical"):
                slowest = [max(r[i][kind]["seconds"] for r in per_rank) for i in range(rounds)]
                last = [r[-1][kind] for r in per_rank]
                rows.append({"part": "all-to-all", "case": kind, "size": n,
                             "latency": latency,
                             "measured": statistics.median(slowest), "rounds": slowest,
                             "ratios": [s / f for s, f in zip(slowest, flat, strict=True)],
                             "messages_across": max(r["messages"] for r in last),
                             "bytes_across": max(r["bytes"] for r in last),
                             "charged_across": max(r["charged"] for r in last),
                             "predicted": all_to_all_time(
                                 kind, nbytes, 2, PER_NODE, alpha, beta,
                                 alpha + link.alpha, beta + link.beta)})
        # the emulated cluster as the planner sees it: 2 nodes of 2 CPU ranks
        machine = dataclasses.replace(
            this_machine(4, flops, bandwidth, alpha, beta), nodes=2, devices_per_node=PER_NODE,
            nic_bandwidth=1 / (beta + ACROSS.beta), inter_latency=alpha + ACROSS.alpha,
            name="2 emulated nodes x 2")
        model = TransformerConfig(SHAPE["layers"], SHAPE["hidden"], SHAPE["heads"],
                                  SHAPE["seq_len"], SHAPE["vocab"])
        layout = Layout(2, 1, 2, micro_batch=BATCH // (2 * MICROBATCHES), recompute="none")
        found: dict[str, list] = {name: [] for name in LAYOUTS}
        for i in range(rounds):
            for name, dims in LAYOUTS.items():
                progress(f"decoder step, {name}, round {i + 1} of {rounds}")
                per_rank = ranks.run(layout_steps, dims, steps)
                slowest = statistics.median(max(s) for s in zip(*(r["times"] for r in per_rank),
                                                                strict=True))
                found[name].append((slowest, per_rank))
        inside = [s for s, _ in found["tp inside, dp across"]]
        for name in LAYOUTS:
            slowest = [s for s, _ in found[name]]
            last = found[name][-1][1]
            plan = estimate(model, machine, BATCH, layout, bytes_per_value=4,
                            order=ORDERS[name])
            rows.append({"part": "decoder step", "case": name, "size": BATCH,
                         "measured": statistics.median(slowest), "rounds": slowest,
                         "ratios": [s / b for s, b in zip(slowest, inside, strict=True)],
                         "messages_across": max(r["messages"] for r in last),
                         "bytes_across": max(r["bytes"] for r in last),
                         "charged_across": max(r["charged"] for r in last),
                         "predicted": plan.step, "predicted_tp": plan.seconds["tp"],
                         "predicted_dp": plan.seconds["dp"]})
    return rows


def report(rows: list[dict], out_dir: Path) -> str:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    axes = fig.subplots(1, 2)
    shown = []
    for ax, part in zip(axes, ("all-to-all", "decoder step"), strict=True):
        mine = [r for r in rows if r["part"] == part]
        for r in mine:
            label = (f"{r['case']}, N={r['size']}, {r['latency'] * 1e3:g} ms"
                     if part == "all-to-all" else r["case"])
            ax.scatter(r["predicted"] * 1e3, r["measured"] * 1e3)
            ax.annotate(label, (r["predicted"] * 1e3, r["measured"] * 1e3), fontsize=7)
            shown.append({"what": part, "case": label,
                          "measured": spread([s * 1e3 for s in r["rounds"]], " ms", 1),
                          "vs": ratio_cell(r["ratios"]),
                          "predicted": f"{r['predicted'] * 1e3:.1f} ms",
                          "m": f"{r['messages_across']:g}", "b": f"{r['bytes_across']:,.0f}",
                          "c": f"{r['charged_across'] * 1e3:.1f} ms"})
        top = max(max(r["predicted"], r["measured"]) for r in mine) * 1e3 * 1.1
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--")
        ax.set(title=part, xlabel="predicted ms", ylabel="measured ms")
    save_results(rows, fig, out_dir, "cluster", title="2 emulated nodes x 2 ranks, slow link "
                 "between them: measured vs predicted")
    header = ("4 ranks as 2 nodes x 2 on this machine (slow_network(per_node=2, across=...)): "
              f"{ACROSS.bandwidth / 1e6:g} MB/s between the nodes and the latency a row names "
              f"(the decoder's: {ACROSS.latency * 1e3:g} ms). all-to-all: N rows per peer, 64 "
              f"floats each; decoder: the mesh bench's (hidden {SHAPE['hidden']}, "
              f"{SHAPE['layers']} layers, batch {BATCH}, {MICROBATCHES} micro-batches) at dp=2 "
              "x tp=2. measured: slowest rank, median round (min-max); vs: per-round ratio to "
              "the flat exchange of the same N and latency, or to tp inside; across: what one "
              "rank sent between nodes (per step for the decoder) and the emulated link's "
              "charge for it (slept), as the network counted")
    return "\n".join([header, format_table(shown, [
        ("what", "what"), ("case", "case"), ("measured", "measured (min-max)"),
        ("vs", "vs flat or tp inside"), ("predicted", "predicted"),
        ("m", "messages across"), ("b", "bytes across"), ("c", "charged across")])])
