"""Slow links on demand: an emulated network for ranks that share one machine.

On loopback every link is fast and alike. Inside `slow_network(...)` (entered on every
rank, around the code to slow down) each message minipar sends first costs its sender
the link's time, latency + bytes / bandwidth, slept before the message is posted: a
sender whose network card pushes the bytes out one message after another. Links are
directed pairs of global ranks; `links={(0, 1): Link(...)}` slows both directions of
that pair, and every other pair gets `latency` / `bandwidth`. Every minipar send goes
through it: collectives, send / isend, the pipeline engine. (torch's own dist calls do
not, and an isend sleeps before it returns: on this network it is non-blocking only
after its bytes have left.)

The same numbers are the alpha-beta model's: `Link` (in `minipar.cost`) has `.alpha` and `.beta`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from ..cost import Link


@dataclass(frozen=True)
class Network:
    """Every link's latency and bandwidth: `links` by (src, dst) global rank, `default`
    for the rest."""

    default: Link = Link()
    links: dict[tuple[int, int], Link] = field(default_factory=dict)

    def link(self, src: int, dst: int) -> Link:
        return self.links.get((src, dst), self.default)

    def seconds(self, src: int, dst: int, nbytes: int) -> float:
        """What sending `nbytes` from src to dst costs on this network."""
        return self.link(src, dst).seconds(nbytes)


_active: list[Network] = []


def active() -> Network | None:
    """The network this rank emulates now (the innermost `slow_network`), if any."""
    return _active[-1] if _active else None


@contextmanager
def slow_network(latency: float = 0.0, bandwidth: float = math.inf,
                 links: dict[tuple[int, int], Link] | None = None) -> Iterator[Network]:
    """Emulate a network on this rank: every pair of ranks `latency` seconds and
    `bandwidth` bytes/s apart, except the pairs in `links` (a pair slows both ways)."""
    both = {}
    for (a, b), link in (links or {}).items():
        if not isinstance(link, Link):
            raise ValueError(f"links must map (rank, rank) pairs to Link(latency=, "
                             f"bandwidth=); got {link!r} for {(a, b)}")
        both[(a, b)] = both[(b, a)] = link  # a pair slows both directions
    network = Network(Link(latency, bandwidth), both)
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
        seconds = sum(network.seconds(me, dst, nbytes) for dst, nbytes in messages)
        if seconds:
            # one sleep for all: a card sends its messages one after another, so the costs add
            time.sleep(seconds)
