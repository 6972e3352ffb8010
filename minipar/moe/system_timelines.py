"""Where MoE systems put the exchange, the experts and the weight copies relative to each
other: one GPU's schedule of an MoE layer, built from stated costs as a Timeline (a
model, not a measurement; every GPU of the expert-parallel group does the same).

Rows are streams: "compute" (the experts), "network" (the all-to-all across nodes) and
"copy" (a second channel: host-to-device copies for SE-MoE, the links inside a node for
Parm). An operation starts when its stream is free and what it needs is done; each
stream runs its operations in the order given.

- "ep": dispatch, experts, combine, one after another (lesson 05).
- "pipelined" (Tutel's adaptive pipelining; EPS-MoE does the same for inference): the
  tokens cut into `chunks`; chunk c's experts run while chunk c+1 is dispatched and
  chunk c-1 combined. Each chunk's message pays `latency` again.
- "load, then run" and "prefetch" (SE-MoE): `layers` MoE layers whose experts wait in
  host memory. Without prefetch each layer first copies its experts in; with it, layer
  l+1's copy runs during layer l.
- "tp x ep" and "parm" (Parm, Pan et al. 2024): the experts of a tensor-parallel group
  of `tp` GPUs, which all hold the same tokens. Plainly each GPU sends all of them
  across nodes and the group all-reduces inside the node after the combine; Parm's
  schedule sends 1/tp of them and all-gathers the rest inside the node, chunk by chunk,
  so the inside-node gathers overlap the next chunk's exchange across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..trace import STREAMS, Event, Timeline

SCHEMES = ("ep", "pipelined", "load, then run", "prefetch", "tp x ep", "parm")
_KIND = {"compute": "compute", "network": "all_to_all", "copy": "copy"}


@dataclass(frozen=True)
class LayerCosts:
    """Seconds for one MoE layer on one GPU: the experts' compute on all its tokens, one
    all-to-all of all its tokens (dispatch or combine), the extra per message of a
    chunked exchange, copying its experts from host memory, and moving its tokens inside
    the node (an all-gather or all-reduce of the activations)."""

    experts: float
    exchange: float
    latency: float = 0.0
    load: float = 0.0
    in_node: float = 0.0


def run_streams(ops: list[tuple[str, str, float, tuple[str, ...]]]) -> Timeline:
    """ops: (name, stream, seconds, names it waits for), in each stream's order. Returns
    the Timeline, one row ("rank") per stream in STREAMS order."""
    free = dict.fromkeys(STREAMS, 0.0)
    done: dict[str, float] = {}
    events = []
    for name, stream, seconds, after in ops:
        start = max([free[stream], *(done[a] for a in after)])
        done[name] = free[stream] = start + seconds
        events.append(Event(STREAMS.index(stream), _KIND[stream], name, start, start + seconds))
    return Timeline(events)


def _layer(costs: LayerCosts, prefix: str, after: tuple[str, ...] = ()) -> list:
    return [(f"{prefix}dispatch", "network", costs.exchange, after),
            (f"{prefix}experts", "compute", costs.experts, (f"{prefix}dispatch",)),
            (f"{prefix}combine", "network", costs.exchange, (f"{prefix}experts",))]


def _chunked(costs: LayerCosts, chunks: int, share: float = 1.0, gather: bool = False
             ) -> list:
    """Chunk c's dispatch Dc, experts Ec and combine Cc; with `gather`, each dispatched
    chunk is all-gathered inside the node (Gc) before its experts, and each combined one
    after its combine (GCc)."""
    n, ops = chunks, []
    net = costs.exchange * share / n + costs.latency
    inside = costs.in_node / n / 2  # half the in-node traffic after each exchange

    def dispatch(c):
        ops.append((f"D{c}", "network", net, ()))
        if gather:
            ops.append((f"G{c}", "copy", inside, (f"D{c}",)))

    def combine(c):
        ops.append((f"C{c}", "network", net, (f"E{c}",)))
        if gather:
            ops.append((f"GC{c}", "copy", inside, (f"C{c}",)))

    dispatch(0)
    for c in range(n):
        ready = f"G{c}" if gather else f"D{c}"
        ops.append((f"E{c}", "compute", costs.experts / n, (ready,)))
        if c + 1 < n:
            dispatch(c + 1)  # on the wire before chunk c's combine
        combine(c)
    return ops


def schedule(scheme: str, costs: LayerCosts, chunks: int = 4, layers: int = 3,
             tp: int = 2) -> Timeline:
    """One GPU's Timeline of an MoE layer (`layers` of them for the SE-MoE pair) under
    `scheme`, one of SCHEMES."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}; got {scheme!r}")
    if chunks < 1 or layers < 1 or tp < 1:
        raise ValueError(f"chunks, layers and tp must be >= 1; got {chunks}, {layers}, {tp}")
    if scheme == "ep":
        return run_streams(_layer(costs, ""))
    if scheme == "pipelined":
        return run_streams(_chunked(costs, chunks))
    if scheme in ("load, then run", "prefetch"):
        ops = []
        for layer in range(layers):
            # the copy reuses the buffer of the layer before (one buffer) or of the one
            # before that (two buffers: prefetch), so it waits for that layer to finish
            freed = layer - (2 if scheme == "prefetch" else 1)
            ops.append((f"load {layer}", "copy", costs.load,
                        (f"L{freed} combine",) if freed >= 0 else ()))
            previous = (f"L{layer - 1} combine",) if layer else ()
            ops += _layer(costs, f"L{layer} ", after=(f"load {layer}", *previous))
        return run_streams(ops)
    if scheme == "tp x ep":
        return run_streams(_layer(costs, "") + [("all-reduce in node", "copy", costs.in_node,
                                                  ("combine",))])
    return run_streams(_chunked(costs, chunks, share=1 / tp, gather=True))


def render_schedules(timelines: dict[str, Timeline], width: float = 9.0):
    """The schedules one above the other on one time axis, rows named by stream."""
    from matplotlib.figure import Figure

    from ..plots import render_timeline

    fig = Figure(figsize=(width, 1.3 * len(timelines) + 0.6), layout="constrained")
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    longest = max(t.makespan for t in timelines.values())
    for ax, (name, timeline) in zip(axes, timelines.items(), strict=True):
        render_timeline(timeline, title=f"{name}: {timeline.makespan * 1e3:.1f} ms", ax=ax)
        ax.set_yticks(range(len(timeline.ranks)), [STREAMS[r] for r in timeline.ranks])
        ax.set_xlim(0, longest * 1e3 * 1.02)
        if ax is not axes[-1]:
            ax.set_xlabel("")
    return fig
