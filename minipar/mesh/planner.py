"""Picking the degrees: enumerate (dp, pp, tp, micro-batch, ZeRO stage, recomputation) for
a model on a cluster, keep what fits in memory, estimate each step's time, rank them.

The estimate adds what the course has measured piece by piece, on the critical path,
nothing overlapped:

    step = compute x (m + pp - 1) / m     the 1F1B bubble, m micro-batches
         + tp all-reduces                 4 per layer and micro-batch (6 recomputing)
         + pp sends                       one activation each way per micro-batch
         + dp gradient all-reduce         ring, over the dp group's slowest link
         + optimizer step                 its state streamed through memory once

Compute is the model's FLOPs (`cost.transformer_flops`, plus one more forward under
full recomputation) at `efficiency` x peak: the share of peak a device's matrix
multiplies reach, the one constant the model takes on trust. Links follow the mesh
order of Megatron-LM (tp fastest, then dp, then pp): a group stays inside a node when
its ranks fit in one, and a group that crosses nodes runs at the slowest NIC it touches,
so on a cluster with mixed NICs (Holmes, Yang et al. 2023) it matters which dimension
crosses where. On CPU ranks that outnumber the cores (`cores`), a waiting rank lends its
core to another: the step is then at least all ranks' work over the cores. Left out:
overlap of dp communication with backward, kernel efficiency falling for small
matrices, per-message software overhead beyond alpha, the embedding's extra work on the
first and last stages.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, field

from .. import cost
from ..cost import GB, Link, TransformerConfig
from .mesh import Mesh

OPTIMIZER_BYTES_PER_PARAM = 32  # Adam reads and writes weight, gradient and two moments


@dataclass(frozen=True)
class Hardware:
    """Devices in nodes: per-device peak FLOP/s and memory, the links inside a node, and
    each node's NIC bandwidth per device (one entry per node; uneven for mixed NICs, whose
    traffic between kinds may fall back to a slower path: `cross_nic_bandwidth`)."""

    nodes: int
    devices_per_node: int
    peak_flops: float
    memory_bytes: float
    intra_bandwidth: float  # bytes/s per device inside a node
    nic_bandwidth: tuple[float, ...] | float  # bytes/s per device leaving a node
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    efficiency: float = 0.7  # share of peak a device's large matmuls reach
    memory_bandwidth: float = 2e12  # bytes/s: the optimizer step streams its state
    cores: int | None = None  # CPU ranks: the devices time-share this many cores
    cross_nic_bandwidth: float | None = None  # bytes/s between nodes of different NICs
    name: str = ""

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def nic(self, node: int) -> float:
        n = self.nic_bandwidth
        return n if isinstance(n, int | float) else n[node]


# published machines (data sheets): A100 80GB in DGX nodes with 8 x 200 Gb/s InfiniBand;
# Frontier nodes of 4 MI250X (8 GCDs of 191.5 bf16 TFLOP/s) with 4 x 25 GB/s Slingshot
def selene(nodes: int) -> Hardware:
    return Hardware(nodes, 8, 312e12, 80 * GB, 300e9, 25e9, memory_bandwidth=2e12,
                   name="A100 (Selene)")


def frontier(nodes: int) -> Hardware:
    return Hardware(nodes, 8, 191.5e12, 64 * GB, 50e9, 12.5e9, memory_bandwidth=1.6e12,
                   name="MI250X GCD (Frontier)")


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out on the devices: the degrees and the knobs beside them."""

    dp: int
    pp: int
    tp: int
    micro_batch: int = 1
    zero: int = 0  # ZeRO stage over dp (0: plain data parallelism)
    recompute: str = "selective"  # cost.RECOMPUTE: none, selective or full

    @property
    def label(self) -> str:
        return (f"dp={self.dp} pp={self.pp} tp={self.tp} mb={self.micro_batch} "
                f"zero={self.zero} recompute={self.recompute}")


@dataclass(frozen=True, kw_only=True)
class Plan(Layout):
    """A layout and what the model predicts for it."""

    memory: float  # bytes on the fullest device
    seconds: dict[str, float] = field(default_factory=dict)  # compute, bubble, tp, pp, dp, ...
    flops: float = 0.0  # counted per step, recomputation included (as Megatron-LM reports)
    devices: int = 1
    peak_flops: float = 1.0

    @property
    def step(self) -> float:
        return sum(self.seconds.values())

    @property
    def tflops_per_device(self) -> float:
        return self.flops / self.step / self.devices / 1e12

    @property
    def share_of_peak(self) -> float:
        return self.flops / self.step / self.devices / self.peak_flops



def _link(cluster: Hardware, ranks: list[int]) -> Link:
    """The link of a group: inside a node, or the slowest NIC it touches."""
    # ranks are numbered node by node: devices_per_node consecutive ranks share a node
    nodes = {r // cluster.devices_per_node for r in ranks}
    if len(nodes) == 1:
        return Link(cluster.intra_latency, cluster.intra_bandwidth)
    nics = {cluster.nic(n) for n in nodes}
    if len(nics) > 1 and cluster.cross_nic_bandwidth is not None:  # e.g. InfiniBand to RoCE
        return Link(cluster.inter_latency, cluster.cross_nic_bandwidth)
    return Link(cluster.inter_latency, min(nics))


def _slowest(links: list[Link]) -> Link:
    """The group that limits a dimension: least bandwidth, then most latency."""
    # a collective runs at its slowest group's pace: every group must finish the step
    return min(links, key=lambda link: (link.bandwidth, -link.latency))


MEGATRON_ORDER = ("pp", "dp", "tp")  # the mesh's dimensions, outermost (slowest) first


@functools.lru_cache(maxsize=4096)
def _links(cluster: Hardware, dp: int, pp: int, tp: int,
           order: tuple[str, ...] = MEGATRON_ORDER) -> dict[str, Link]:
    """Each dimension's slowest group's link, ranks laid out in `order` (Megatron's: pp
    slowest, dp, tp fastest); for pp, the link between neighbouring stages."""
    if sorted(order) != sorted(MEGATRON_ORDER):
        raise ValueError(f"order must name each of {MEGATRON_ORDER} once; got {order!r}")
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    mesh = Mesh(**{name: sizes[name] for name in order})
    return {"tp": _slowest([_link(cluster, g) for g in mesh.groups("tp")]),
            "dp": _slowest([_link(cluster, g) for g in mesh.groups("dp")]),
            "pp": _slowest([_link(cluster, g[i:i + 2]) for g in mesh.groups("pp")
                            for i in range(pp - 1)]) if pp > 1 else Link()}


def estimate(model: TransformerConfig, cluster: Hardware, global_batch: int, layout: Layout,
             bytes_per_value: int = 2, order: tuple[str, ...] = MEGATRON_ORDER) -> Plan:
    """The memory and step time the model predicts for one layout, its ranks numbered in
    `order` (outermost first; the default keeps tp's groups inside a node, as `plan`
    always does: ("pp", "tp", "dp") is the alternative that puts tp across nodes)."""
    dp, pp, tp = layout.dp, layout.pp, layout.tp
    micro_batch, zero, recompute = layout.micro_batch, layout.zero, layout.recompute
    if dp * pp * tp != cluster.devices:
        raise ValueError(f"dp * pp * tp must equal the cluster's {cluster.devices} devices; "
                         f"got {dp} * {pp} * {tp}")
    m = global_batch // (dp * micro_batch)
    if m < 1 or global_batch % (dp * micro_batch):
        raise ValueError(f"global_batch={global_batch} must be a multiple of dp * micro_batch "
                         f"= {dp * micro_batch}")
    # the fullest stage sets the memory: it holds ceil(layers / pp) layers
    layers = math.ceil(model.layers / pp)
    params = model.params / (pp * tp)
    states = cost.zero_memory(cost.training_memory(params, master_weights="fp32"), zero, dp)
    in_flight = min(pp, m)  # 1F1B: the first stage holds pp micro-batches
    # the estimate assumes Megatron's sequence parallelism on: every activation divides by tp
    activations = cost.activation_bytes(layers, model.hidden, model.seq_len, micro_batch,
                                        model.heads, recompute, tp=tp,
                                        sequence_parallel=True) * in_flight
    tokens = global_batch * model.seq_len
    per_token = sum(cost.transformer_flops(model).values())
    # backward costs about twice the forward, so forward is 1/3 of a step: one more forward
    # under full recomputation is 4/3 of the work (Narayanan et al. 2021 count it so too)
    flops = per_token * tokens * (4 / 3 if recompute == "full" else 1)
    compute = flops / (cluster.devices * cluster.peak_flops * cluster.efficiency)
    activation = micro_batch * model.seq_len * model.hidden * bytes_per_value
    links = _links(cluster, dp, pp, tp, tuple(order))
    ring = cost.all_reduce_cost("ring", tp, activation, links["tp"].alpha,
                                links["tp"].beta).seconds
    # Megatron's count: two g's forward (after attention, after the MLP), two f's backward (4);
    # recomputing the forward runs its two all-reduces again (6)
    tp_time = layers * m * (6 if recompute == "full" else 4) * ring
    # m + pp - 1 sends on the critical path each way; each tp rank sends its 1/tp of the
    # activation (Megatron's scatter/gather optimization, Narayanan et al. 2021)
    pp_time = 2 * (m + pp - 1) * links["pp"].seconds(activation / tp) if pp > 1 else 0.0
    # once per step, after the last micro-batch: gradients accumulate over the m micro-batches
    dp_time = cost.all_reduce_cost("ring", dp, params * bytes_per_value, links["dp"].alpha,
                                   links["dp"].beta).seconds
    updated = params / (dp if zero >= 1 else 1)  # ZeRO: each rank updates its slice
    optimizer = updated * OPTIMIZER_BYTES_PER_PARAM / cluster.memory_bandwidth
    # 1F1B's bubble: (pp - 1) / m of the compute (GPipe's, Huang et al. 2019; 1F1B keeps it
    # and only lowers the memory)
    seconds = {"compute": compute, "bubble": compute * (pp - 1) / m, "tp": tp_time,
               "pp": pp_time, "dp": dp_time, "optimizer": optimizer}
    if cluster.cores and cluster.devices > cluster.cores:
        # every rank's work (a bubble is no work: a waiting rank lends its core) over the
        # cores: when that exceeds the critical path, ranks wait for a core instead
        work = (sum(seconds.values()) - seconds["bubble"]) * cluster.devices / cluster.cores
        seconds["sharing cores"] = max(0.0, work - sum(seconds.values()))
    return Plan(**asdict(layout), memory=states.total + activations, seconds=seconds,
                flops=flops, devices=cluster.devices, peak_flops=cluster.peak_flops)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(model: TransformerConfig, cluster: Hardware, global_batch: int,
         micro_batches: tuple[int, ...] = (1, 2, 4, 8), zero_stages: tuple[int, ...] = (0, 1),
         recompute: tuple[str, ...] = cost.RECOMPUTE) -> list[Plan]:
    """Every configuration that fits in the device's memory, fastest first (then least
    memory). tp divides the heads, pp the layers (evenly split stages), dp x micro-batch
    the global batch."""
    n = cluster.devices
    found = []
    for tp, pp in itertools.product(_divisors(n), _divisors(n)):
        if n % (tp * pp) or model.heads % tp or model.layers % pp:
            continue
        dp = n // (tp * pp)
        for mb, z, rc in itertools.product(micro_batches, zero_stages, recompute):
            # ZeRO over one rank shards nothing: the same layout as z = 0, listed once
            if global_batch % (dp * mb) or (z and dp == 1):
                continue
            p = estimate(model, cluster, global_batch, Layout(dp, pp, tp, mb, z, rc))
            if p.memory <= cluster.memory_bytes:
                found.append(p)
    # rounded: steps equal but for float noise tie, and the tie goes to less memory
    return sorted(found, key=lambda p: (round(p.step, 9), p.memory))


def explain(best: Plan, cluster: Hardware, plans: list[Plan] | None = None) -> str:
    """Why the winner wins, in the terms of the estimate. With `plans` (what `plan`
    returned) it can tell a pipeline needed to fit from one chosen for its links."""
    total = best.step
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in best.seconds.items() if v > 0)
    inside = "inside one node" if best.tp <= cluster.devices_per_node else "across nodes"
    bubble = f"a bubble of (pp-1)/m = {best.seconds['bubble'] / best.seconds['compute']:.0%}"
    if best.pp == 1:
        pipeline = "pp=1: no pipeline, no bubble"
    elif plans is not None and any(p.pp == 1 for p in plans):
        crosses = best.dp * best.tp >= cluster.devices_per_node and cluster.nodes > 1
        pipeline = (f"pp={best.pp} is not needed to fit; it puts the links between nodes on "
                    "the pipeline, which sends one activation per micro-batch, instead of on "
                    f"the gradient all-reduce, at {bubble} of compute" if crosses else
                    f"pp={best.pp} is not needed to fit; it costs less than more dp or tp, at "
                    f"{bubble} of compute")
    else:
        pipeline = f"pp={best.pp} splits the model so it fits, at {bubble} of compute"
    return (f"{best.label}: {total:.2f} s per step, {best.tflops_per_device:.0f} TFLOP/s per "
            f"device ({best.share_of_peak:.0%} of peak), {best.memory / GB:.0f} of "
            f"{cluster.memory_bytes / GB:.0f} GB. Time goes to {shares}. tp={best.tp} keeps "
            f"the per-layer all-reduces {inside}; {pipeline}; dp={best.dp} replicas share the "
            "batch.")
