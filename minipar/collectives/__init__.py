"""Every collective, written on point-to-point messages, with a meter.

Call these inside a rank (from `minipar.launch` or a Cluster). Each one moves data
only with `isend`/`irecv`; the algorithms are the ones a course on parallel
training draws:

- ``all_reduce(t, algorithm=...)``: "naive" (everyone sends to rank 0, which sends
  the result back), "tree" (binomial tree reduce, then broadcast), "ring"
  (reduce-scatter then all-gather, K-1 steps each) and "halving_doubling"
  (recursive halving reduce-scatter, recursive doubling all-gather);
  ``pipelined_ring_all_reduce`` is the ring with its steps overlapped segment by segment.
- ``broadcast``, ``reduce`` ("naive" or "tree"), ``scatter``, ``gather``,
  ``all_gather`` (ring), ``reduce_scatter`` (ring) and ``all_to_all``.

How sends and receives are paired (deadlock-free on gloo and NCCL): every step
posts all of its sends and receives together in one `batch_isend_irecv` and waits
on every request before the next step. Ranks never block in a send while their
peer blocks in a send.

Chunks are those of ``torch.tensor_split(t, world_size)``: along dim 0 for
scatter / reduce_scatter / all_to_all, over the flattened tensor inside all_reduce.
Empty chunks are not sent. Long chunks travel in segments of SEGMENT_BYTES, and a
receiving rank reduces each segment as soon as it lands while later ones are still
in flight.

Slow links: inside ``slow_network(latency=, bandwidth=, links=)`` every message pays
its link's time before it leaves (network.py), so a slow or uneven network is
something a lesson can turn on; ``per_node=, across=`` slows only the links between
nodes of ranks, a cluster on one machine.

Checks: arguments are checked on every rank before any message is sent. With
validation on (the default, see `validation`) the ranks also compare shapes,
dtypes and arguments with one small all-gather of metadata (not metered, not part
of the algorithm) and all raise the same ValueError if they disagree, instead of
hanging or returning garbage.
"""

from .all_reduce import ALL_REDUCE_ALGORITHMS, all_gather, all_reduce, reduce_scatter
from .all_to_all import all_to_all, swap_counts
from .comm import (
           OPS,
           ROOTED_ALGORITHMS,
           SEGMENT_BYTES,
           Meter,
           Transfer,
           meter,
           split_bounds,
           validation,
)
from .fit import fit_machine
from .network import Link, Network, slow_network
from .p2p import (
    Pending,
    PendingRecv,
    PendingSend,
    irecv,
    isend,
    post_together,
    recv,
    recv_any,
    send,
    sendrecv,
)
from .pipelined_ring import pipelined_ring_all_reduce
from .rooted import broadcast, gather, reduce, scatter

__all__ = ["ALL_REDUCE_ALGORITHMS", "OPS", "ROOTED_ALGORITHMS", "SEGMENT_BYTES", "Link",
           "Meter", "Network", "Pending", "PendingRecv", "PendingSend", "Transfer",
           "all_gather", "all_reduce", "all_to_all", "broadcast", "fit_machine", "gather",
           "irecv", "isend", "meter", "pipelined_ring_all_reduce", "post_together", "recv",
           "recv_any", "reduce", "reduce_scatter", "scatter", "send", "sendrecv",
           "slow_network", "split_bounds", "swap_counts", "validation"]
