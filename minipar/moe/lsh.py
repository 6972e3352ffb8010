"""LSH-MoE (Nie et al. 2024): send fewer rows through the all-to-all by sending, for each
expert, one centroid per group of similar tokens.

Tokens bound for the same expert are hashed (the paper uses cross-polytope hashing;
here the simpler random-hyperplane family, SimHash: the sign of x . h_i for `bits`
hyperplanes, so similar tokens land in the same bucket); each bucket
travels as its mean, the expert runs on the means, and every token takes its bucket's
output. The paper adds residual-based error compensation; here, as we read it, each
token adds back its own residual x - mean, kept at home (`compensate=True`). That is
exact for an expert that passes its input through, and can hurt for one that does not:
lesson 09 measures both.
The all-to-all then moves buckets instead of tokens: the compression ratio is tokens /
buckets. Exact when every token has its own bucket.
"""

from __future__ import annotations

import torch

from .layer import MoELayer
from .routing import route


def lsh_buckets(x: torch.Tensor, bits: int, seed: int = 0) -> torch.Tensor:
    """Each row's bucket: the signs of its projections on `bits` random hyperplanes, read
    as a binary number (the same hyperplanes on every rank: a shared seed). The planes
    for b bits are the first b of those for more bits, so more bits refine the buckets."""
    if not 1 <= bits <= 62:
        raise ValueError(f"bits must be between 1 and 62; got {bits}")
    planes = torch.randn(bits, x.shape[-1], generator=torch.Generator().manual_seed(seed),
                         dtype=x.dtype).t()  # row by row: plane i is the same for any bits
    signs = (x @ planes > 0).long()
    return (signs * (2 ** torch.arange(bits))).sum(-1)


class LSHMoE(MoELayer):
    """MoELayer whose dispatch sends, per expert, one centroid per LSH bucket. With
    `compensate`, each token's output adds its residual from the centroid. `last_rows`
    holds (token choices routed, centroids sent) of the last call."""

    def __init__(self, *args, bits: int = 4, compensate: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bits, self.compensate = bits, compensate
        self.last_rows = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(self.gate(x), self.k, self.capacity_factor, self.min_capacity,
                        self.order)
        self.last_routing = routing
        bucket = lsh_buckets(x.detach(), self.bits)
        y = x.new_zeros(x.shape)
        routed = sent = 0
        for e, expert in enumerate(self.experts):
            token, choice = torch.nonzero((routing.expert == e) & routing.kept, as_tuple=True)
            if not len(token):
                continue
            groups, which = torch.unique(bucket[token], return_inverse=True)
            sums = x.new_zeros(len(groups), x.shape[1]).index_add(0, which, x[token])
            centroids = sums / torch.bincount(which, minlength=len(groups)).unsqueeze(-1)
            out = expert(centroids)[which]  # each token gets its bucket's output
            if self.compensate:
                out = out + (x[token] - centroids[which])
            y = y.index_add(0, token, out * routing.weight[token, choice].unsqueeze(-1))
            routed, sent = routed + len(token), sent + len(groups)
        self.last_rows = (routed, sent)
        return y + self.shared(x) if self.shared is not None else y

    @property
    def compression(self) -> float:
        """Rows the all-to-all would carry exactly, over the rows it carries here."""
        routed, sent = self.last_rows
        return routed / sent if sent else 1.0
