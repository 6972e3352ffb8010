"""Slow links on demand: an emulated network for ranks that share one machine.

On loopback every link is fast and alike. Inside `slow_network(...)` (entered on every
rank, around the code to slow down) each message minipar sends first costs its sender
the link's time, latency + bytes / bandwidth, slept before the message is posted: a
sender whose network card pushes the bytes out one message after another. Links are
directed pairs of global ranks; `links={(0, 1): Link(...)}` slows both directions of
that pair, and every other pair gets `latency` / `bandwidth`. With `per_node=n` and
`across=Link(...)` the ranks form nodes of n (ranks 0..n-1 the first, numbered node by
node, as torchrun and the Mesh number them) and only messages between two nodes pay
`across`: a cluster's slow link between machines, on one machine. The network counts
what it charged (`traffic`: messages, bytes and seconds, inside a node and across).
Every minipar send goes
through it: collectives, send / isend, the pipeline engine. (torch's own dist calls do
not, and an isend sleeps before it returns: on this network it is non-blocking only
after its bytes have left.)

The same numbers are the alpha-beta model's: `Link` (in `minipar.cost`) has `.alpha` and `.beta`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from ..cost import Link


@dataclass(frozen=True)
class Network:
    """Every link's latency and bandwidth: `links` by (src, dst) global rank, `across`
    between ranks of different nodes of `per_node`, `default` for the rest. `traffic`
    counts what this rank was charged ("messages across", "bytes inside", "seconds
    across", ...)."""

    default: Link = Link()
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    per_node: int | None = None
    across: Link | None = None
    traffic: Counter = field(default_factory=Counter, compare=False)

    def crosses(self, src: int, dst: int) -> bool:
        """True when src and dst sit on different nodes (never without `per_node`)."""
        return self.per_node is not None and src // self.per_node != dst // self.per_node

    def link(self, src: int, dst: int) -> Link:
        if (src, dst) in self.links:
            return self.links[(src, dst)]
        return self.across if self.crosses(src, dst) else self.default

    def seconds(self, src: int, dst: int, nbytes: int) -> float:
        """What sending `nbytes` from src to dst costs on this network."""
        return self.link(src, dst).seconds(nbytes)


_active: list[Network] = []


def active() -> Network | None:
    """The network this rank emulates now (the innermost `slow_network`), if any."""
    return _active[-1] if _active else None


@contextmanager
def slow_network(latency: float = 0.0, bandwidth: float = math.inf,
                 links: dict[tuple[int, int], Link] | None = None,
                 per_node: int | None = None, across: Link | None = None
                 ) -> Iterator[Network]:
    """Emulate a network on this rank: every pair of ranks `latency` seconds and
    `bandwidth` bytes/s apart, except the pairs in `links` (a pair slows both ways) and,
    with `per_node`, pairs on different nodes of `per_node` ranks, which pay `across`."""
    if (per_node is None) != (across is None):
        raise ValueError("per_node and across go together: per_node=2, across=Link(latency=, "
                         f"bandwidth=) makes nodes of 2; got per_node={per_node!r}, "
                         f"across={across!r}")
    if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int)
                                 or per_node < 1 or not isinstance(across, Link)):
        raise ValueError(f"per_node must be a positive int and across a Link(latency=, "
                         f"bandwidth=); got per_node={per_node!r}, across={across!r}")
    both = {}
    for (a, b), link in (links or {}).items():
        if not isinstance(link, Link):
            raise ValueError(f"links must map (rank, rank) pairs to Link(latency=, "
                             f"bandwidth=); got {link!r} for {(a, b)}")
        both[(a, b)] = both[(b, a)] = link  # a pair slows both directions
    network = Network(Link(latency, bandwidth), both, per_node, across)
    _active.append(network)
    try:
        yield network
    finally:
        _active.remove(network)


def pay_for_sends(messages: Iterable[tuple[int, int]]) -> None:
    """Sleep what `messages` [(destination global rank, bytes)] cost this rank on the
    active network, one after another. Without one it returns at once, before reading
    `messages` (pass a generator: the hot path builds nothing)."""
    network = active()
    if network is not None:
        me = dist.get_rank()  # the global rank: links are keyed by global ranks
        seconds = 0.0
        for dst, nbytes in messages:
            cost = network.seconds(me, dst, nbytes)
            where = "across" if network.crosses(me, dst) else "inside"
            network.traffic.update({f"messages {where}": 1, f"bytes {where}": nbytes})
            network.traffic[f"seconds {where}"] += cost
            seconds += cost
        if seconds:
            # one sleep for all: a card sends its messages one after another, so the costs add
            time.sleep(seconds)
