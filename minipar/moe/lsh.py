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
from .rule import Choices, RoutingRule
from .top_k import TopKCapacity


def lsh_buckets(x: torch.Tensor, bits: int, seed: int = 0) -> torch.Tensor:
    """Each row's bucket: the signs of its projections on `bits` random hyperplanes, read
    as a binary number (the same hyperplanes on every rank: a shared seed). The planes
    for b bits are the first b of those for more bits, so more bits refine the buckets."""
    if not 1 <= bits <= 62:
        raise ValueError(f"bits must be between 1 and 62; got {bits}")
    # SimHash (random hyperplanes), not the paper's cross-polytope hashing: simpler, and
    # similar tokens still share buckets
    # a CPU generator draws on the host: moved just below
    planes = torch.randn(bits, x.shape[-1], generator=torch.Generator().manual_seed(seed),
                         dtype=x.dtype).t()  # row by row: plane i is the same for any bits
    signs = (x @ planes.to(x.device) > 0).long()
    return (signs * (2 ** torch.arange(bits, device=x.device))).sum(-1)


def bucket_means(rows: torch.Tensor, expert: torch.Tensor, bucket: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (expert, bucket) pair among the token choices `rows` (bound for
    `expert`, hashed to `bucket`): the mean of its rows. Returns (means, the pairs [G, 2]
    sorted by expert, and each choice's pair index)."""
    pairs, which = torch.unique(torch.stack([expert, bucket], dim=1), dim=0,
                                return_inverse=True)
    sums = rows.new_zeros(len(pairs), rows.shape[1]).index_add(0, which, rows)
    return sums / torch.bincount(which, minlength=len(pairs)).unsqueeze(-1), pairs, which


def centroid_outputs(out: torch.Tensor, which: torch.Tensor, rows: torch.Tensor,
                     means: torch.Tensor, compensate: bool) -> torch.Tensor:
    """Each token choice's output: its bucket mean's output, plus (with `compensate`) its
    own residual rows - mean, which never left home."""
    # LSH-MoE's residual compensation as we read it: exact for an identity expert
    return out[which] + (rows - means[which]) if compensate else out[which]


class LSHCentroids(RoutingRule):
    """Token choice by `within` (top-k with capacity), but what travels to an expert is
    one centroid per LSH bucket of the tokens bound for it; each choice takes its
    bucket's output (plus its own residual with `compensate`)."""

    def __init__(self, within: TopKCapacity, bits: int = 4, compensate: bool = True) -> None:
        self.within, self.bits, self.compensate = within, bits, compensate

    def __repr__(self) -> str:
        return f"LSHCentroids({self.within!r}, bits={self.bits}, compensate={self.compensate})"

    def choose(self, logits: torch.Tensor) -> Choices:
        return self.within.choose(logits)

    def choose_global(self, logits: torch.Tensor, per_rank: int, group=None) -> Choices:
        return self.within.choose_global(logits, per_rank, group)

    def pack(self, x: torch.Tensor, choices: Choices
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        # buckets of this rank's own tokens only: a centroid never mixes ranks (the paper's
        # compression happens before the all-to-all)
        chosen = x[choices.token]
        means, pairs, which = bucket_means(chosen, choices.expert,
                                           lsh_buckets(x.detach(), self.bits)[choices.token])
        expert = pairs[:, 0]
        return means, expert, torch.zeros_like(expert), (which, chosen, means)

    def unpack(self, out: torch.Tensor, state: object) -> torch.Tensor:
        which, chosen, means = state
        return centroid_outputs(out, which, chosen, means, self.compensate)


class LSHMoE(MoELayer):
    """MoELayer whose dispatch sends, per expert, one centroid per LSH bucket (the
    `LSHCentroids` rule). With `compensate`, each token's output adds its residual from
    the centroid. `last_rows` holds (token choices routed, centroids sent) of the last
    call."""

    def __init__(self, *args, bits: int = 4, compensate: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rule = LSHCentroids(self.rule, bits, compensate)
        self.last_rows = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choices = self.rule.choose(self.gate(x))
        self.last_routing = choices.routing
        means, expert, _, state = self.rule.pack(x, choices)
        out = means.new_zeros(means.shape)
        for e, module in enumerate(self.experts):
            (rows,) = torch.nonzero(expert == e, as_tuple=True)
            out = out.index_put((rows,), module(means[rows]))
        out = self.rule.unpack(out, state)
        y = x.new_zeros(x.shape).index_add(0, choices.token, out * choices.weight.unsqueeze(-1))
        self.last_rows = (len(choices.token), len(means))
        return y + self.shared(x) if self.shared is not None else y

    @property
    def compression(self) -> float:
        """Rows the all-to-all would carry exactly, over the rows it carries here."""
        routed, sent = self.last_rows
        return routed / sent if sent else 1.0
