"""Gradient compression with error feedback: send less, remember what you did not send.

A compressor turns a gradient into a smaller payload and back. With error feedback
(Seide et al. 2014; Karimireddy et al. 2019) each rank adds last step's compression
error to this step's gradient before compressing, so nothing is lost for good: it
is only delayed. The error a rank keeps is its corrected gradient minus what of it
reached the applied average (`Compressor.delivered`): for top-k and int8 that is its
own decompressed payload (the average is the mean of those); for PowerSGD it is the
averaged approximation itself (Vogels et al. 2019, Algorithm 2). Either way, over any
number of steps, the applied updates plus the ranks' mean residual add up to the sum
of the mean gradients.

- `TopK(ratio)`: keep the largest ratio x n entries (values + int32 indices); ranks
  all-gather each other's entries and average. 8 bytes per kept entry.
- `RandK(ratio, seed)`: keep k entries chosen at random (each rank its own draw), scaled
  by n/k so the average is unbiased: the compressor MASHA1 (slow_networks/masha.py) needs.
  Same payload as top-k.
- `Int8()`: one fp32 scale and one int8 per entry (max |x| maps to 127); ranks
  all-gather and average. About 1/4 of fp32.
- `PowerSGD(rank)`: a matrix M (n x m) is sent as P (n x r) and Q (m x r) with M ~ P Q^T,
  one power iteration per step warm-started from last step's Q (Vogels et al. 2019);
  P and Q are linear in M, so the ranks all-reduce them directly. Vectors go
  uncompressed.
- `choose_levels`: per layer, pick one compressor from a menu so that the total
  squared error stays within a budget with the fewest bytes (a small dynamic
  program, in the spirit of L-GreCo, Alimohammadi et al. 2023).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import collectives
from ..runtime import rank, world_size
from .ddp import shard, shard_weight


class Compressor:
    """Compress one tensor and all-reduce (average) it across ranks in compressed form."""

    name = "none"

    def round_trip(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        """What this rank's tensor looks like after compression and decompression."""
        # a new tensor, as the lossy compressors return, never an alias of the input
        return tensor.clone()

    def average(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        """Average over ranks, exchanging only compressed data."""
        # all_reduce works in place: the caller's gradient stays as it was
        out = tensor.clone()
        return collectives.all_reduce(out, op="avg")

    def delivered(self, tensor: torch.Tensor, averaged: torch.Tensor,
                  key: str = "") -> torch.Tensor:
        """The part of this rank's `tensor` that reached `averaged`, the mean that was
        applied: what error feedback must not carry over to the next step."""
        return self.round_trip(tensor, key)

    def payload_bytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()


class TopK(Compressor):
    """Keep the ratio x n largest-magnitude entries."""

    def __init__(self, ratio: float) -> None:
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1] (the share of entries kept); got {ratio!r}")
        self.ratio, self.name = float(ratio), f"top-{ratio:g}"

    def _k(self, tensor: torch.Tensor) -> int:
        # at least one entry, so a tiny tensor still sends something
        return max(1, math.ceil(self.ratio * tensor.numel()))

    def _pick(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # largest by magnitude; int32 indices, half the bytes of int64 (payload_bytes counts 4)
        indices = flat.abs().topk(self._k(flat)).indices.to(torch.int32)
        return flat[indices.long()], indices

    def round_trip(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        flat = tensor.reshape(-1)
        values, indices = self._pick(flat)
        return torch.zeros_like(flat).index_put_((indices.long(),), values).view_as(tensor)

    def average(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        flat = tensor.reshape(-1)
        values, indices = self._pick(flat)
        all_values = collectives.all_gather(values)
        all_indices = collectives.all_gather(indices).long()
        # index_add_, not index_put_: two ranks may have kept the same index, and both count
        out = torch.zeros_like(flat).index_add_(0, all_indices, all_values)
        # divide by K: an entry a rank did not keep counts as zero from that rank
        return (out / world_size()).view_as(tensor)

    def payload_bytes(self, tensor: torch.Tensor) -> int:
        return self._k(tensor) * (tensor.element_size() + 4)

    @classmethod
    def keeping(cls, k: int, n: int, **options) -> TopK:
        """The compressor that keeps exactly k of an n-entry tensor's entries."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"k must be an int in 1..{n} (entries kept of {n}); got {k!r}")
        # k/n can round up to k+1 under ceil (k=7, n=25); half an entry below k cannot
        compressor = cls((k - 0.5) / n, **options)
        compressor.name = f"{cls.__name__.lower()}-{k}/{n}"
        return compressor


class RandK(TopK):
    """Keep k entries drawn uniformly at random, scaled by n/k: E[RandK(x)] = x (unbiased),
    at the price of variance (n/k - 1)|x|^2. Each rank draws from its own generator,
    seeded by (seed, rank), so the ranks' draws are independent and every run repeats."""

    def __init__(self, ratio: float, seed: int = 0) -> None:
        super().__init__(ratio)
        self.name, self.seed = f"rand-{ratio:g}", seed
        self._generator: torch.Generator | None = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the latest draw

    def _pick(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._generator is None:  # seeded on first use, inside the rank
            self._generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rank())
        k = self._k(flat)
        # a CPU generator draws on the host, moved just below
        indices = torch.randperm(flat.numel(), generator=self._generator)[:k]
        indices = indices.to(device=flat.device, dtype=torch.int32)
        # the n/k scale makes the compressor unbiased: each entry survives with probability k/n
        values = flat[indices.long()] * (flat.numel() / k)
        self._last = values, indices
        return values, indices

    def delivered(self, tensor: torch.Tensor, averaged: torch.Tensor,
                  key: str = "") -> torch.Tensor:
        """This rank's part of the last average (a fresh round trip would draw new indices)."""
        values, indices = self._last
        flat = torch.zeros_like(tensor.reshape(-1))
        return flat.index_put_((indices.long(),), values).view_as(tensor)


class Int8(Compressor):
    """One scale per tensor, one signed byte per entry."""

    name = "int8"

    @staticmethod
    def _quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 127, the largest int8: a symmetric range [-127, 127]; clamp_min: an all-zero tensor
        # would otherwise divide by zero
        scale = tensor.abs().max().clamp_min(1e-30) / 127
        return torch.round(tensor / scale).to(torch.int8), scale.reshape(1).to(torch.float32)

    def round_trip(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        q, scale = self._quantize(tensor)
        return (q.to(tensor.dtype) * scale.to(tensor.dtype)).view_as(tensor)

    def average(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        q, scale = self._quantize(tensor.reshape(-1))
        all_q = collectives.all_gather(q).view(world_size(), -1).to(tensor.dtype)
        all_scales = collectives.all_gather(scale).to(tensor.dtype)
        return (all_q * all_scales[:, None]).mean(0).view_as(tensor)

    def payload_bytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() + 4


class PowerSGD(Compressor):
    """Rank-r approximation of matrices by one warm-started power iteration."""

    def __init__(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1; got {rank!r}")
        self.rank, self.name = rank, f"powersgd-{rank}"
        self._q: dict[str, torch.Tensor] = {}

    def _as_matrix(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor.reshape(tensor.shape[0], -1) if tensor.dim() >= 2 else None

    def _q_for(self, key: str, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        q = self._q.get(key)
        if q is None or q.shape != (m, r):
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))  # same everywhere
            # a CPU generator draws on the host: moved just below
            q = torch.randn(m, r, generator=generator, dtype=like.dtype).to(like.device)
        return q

    def _approximate(self, matrix: torch.Tensor, key: str, reduce: bool) -> torch.Tensor:
        # a rank above either dimension would add nothing
        r = min(self.rank, *matrix.shape)
        q = self._q_for(key, matrix.shape[1], r, matrix)
        p = matrix @ q
        # P = M Q is linear in M: the average of the ranks' P is the P of the average M
        if reduce:
            collectives.all_reduce(p, op="avg")
        # orthonormal columns (PowerSGD, Algorithm 1): then P (M^T P)^T projects M onto span(P)
        p = torch.linalg.qr(p).Q
        q = matrix.t() @ p
        if reduce:
            collectives.all_reduce(q, op="avg")
        # kept as next step's warm start: one power iteration a step, continued across steps
        self._q[key] = q
        return p @ q.t()

    def round_trip(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        matrix = self._as_matrix(tensor)
        if matrix is None:
            return tensor.clone()
        saved = dict(self._q)  # a round trip must not move the warm start
        out = self._approximate(matrix, key, reduce=False).view_as(tensor)
        self._q = saved
        return out

    def average(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        matrix = self._as_matrix(tensor)
        if matrix is None:
            return super().average(tensor, key)
        return self._approximate(matrix, key, reduce=True).view_as(tensor)

    def delivered(self, tensor: torch.Tensor, averaged: torch.Tensor,
                  key: str = "") -> torch.Tensor:
        """P and Q are all-reduced before decompressing, so no rank's own approximation is
        ever applied: what reached the average is the averaged approximation itself."""
        return averaged if self._as_matrix(tensor) is not None else tensor

    def payload_bytes(self, tensor: torch.Tensor) -> int:
        matrix = self._as_matrix(tensor)
        if matrix is None:
            return super().payload_bytes(tensor)
        r = min(self.rank, *matrix.shape)
        return (matrix.shape[0] + matrix.shape[1]) * r * tensor.element_size()


class ErrorFeedback:
    """Per-tensor residuals: compress (gradient + last residual), keep what was lost."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def average(self, compressor: Compressor, tensor: torch.Tensor, key: str) -> torch.Tensor:
        # the error feedback: what earlier steps failed to deliver is added back before compressing
        corrected = tensor + self.residuals.get(key, torch.zeros_like(tensor))
        averaged = compressor.average(corrected, key)
        self.residuals[key] = corrected - compressor.delivered(corrected, averaged, key)
        return averaged


def choose_levels(errors: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]],
                  budget: float, resolution: int = 200) -> list[int]:
    """Per layer, the option index minimizing total bytes with total error <= budget.

    errors[l][o] and sizes[l][o] are layer l's squared error and bytes under option o.
    Errors are rounded up to budget/resolution units, so the budget is never exceeded.
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0; got {budget!r}")
    unit = budget / resolution
    inf = float("inf")
    best = [0.0] + [inf] * resolution  # best[e]: fewest bytes with error units e
    choices: list[list[int]] = [[] for _ in range(resolution + 1)]
    for layer_errors, layer_sizes in zip(errors, sizes, strict=True):
        new, new_choices = [inf] * (resolution + 1), [[] for _ in range(resolution + 1)]
        for used in range(resolution + 1):
            if best[used] == inf:
                continue
            for option, (err, nbytes) in enumerate(zip(layer_errors, layer_sizes, strict=True)):
                # - 1e-12: an error of exactly k units must not round up to k + 1 through float
                # noise
                total = used + math.ceil(err / unit - 1e-12)
                if total <= resolution and best[used] + nbytes < new[total]:
                    new[total] = best[used] + nbytes
                    new_choices[total] = choices[used] + [option]
        best, choices = new, new_choices
    finite = [i for i, b in enumerate(best) if b < inf]
    if not finite:
        raise ValueError("no choice of levels meets the error budget; include a lossless "
                         "option (e.g. TopK(1.0)) in the menu")
    return choices[min(finite, key=lambda i: best[i])]


@dataclass
class CompressionReport:
    """Losses per step and payload bytes per step (this rank's compressed gradients)."""

    method: str
    losses: list[float] = field(default_factory=list)
    payload_bytes: list[int] = field(default_factory=list)
    dense_bytes: int = 0
    levels: list[str] = field(default_factory=list)


ADAPTIVE_MENU: tuple[Callable[[], Compressor], ...] = (
    lambda: TopK(0.01), lambda: TopK(0.05), lambda: TopK(0.25), lambda: Int8(), lambda: TopK(1.0))


def train_compressed(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     loss_fn: Callable, lr: float, compressor: Compressor | str,
                     error_feedback: bool = True, error_budget: float = 0.3,
                     replan_every: int = 10) -> CompressionReport:
    """Data-parallel SGD whose gradients travel compressed; call on every rank.

    `compressor="adaptive"` picks a level per layer from ADAPTIVE_MENU every
    `replan_every` steps, keeping the total relative squared error within
    `error_budget`; rank 0 plans from its gradient and broadcasts the plan, since
    all ranks must compress each layer the same way.
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    adaptive = compressor == "adaptive"
    if not adaptive and not isinstance(compressor, Compressor):
        raise ValueError("compressor must be a Compressor or 'adaptive'")
    chosen: dict[str, Compressor] = {}
    feedback = ErrorFeedback()
    report = CompressionReport("adaptive" if adaptive else compressor.name,
                               dense_bytes=sum(p.numel() * p.element_size() for _, p in params))
    for step, (x, y) in enumerate(batches):
        model.zero_grad()
        lx, ly = shard(x), shard(y)
        # the package's loss-scaling rule (ddp.py), so uneven shards still weigh each sample once
        loss = loss_fn(model(lx), ly) * shard_weight(len(lx), len(x))
        loss.backward()
        if adaptive and step % replan_every == 0:
            chosen = _plan(params, error_budget)
            report.levels = [chosen[name].name for name, _ in params]
        sent = 0
        # the update writes into leaf parameters in place, which autograd refuses while recording
        with torch.no_grad():
            for name, p in params:
                method = chosen[name] if adaptive else compressor
                grad = p.grad
                averaged = feedback.average(method, grad, name) if error_feedback \
                    else method.average(grad, name)
                p -= lr * averaged
                sent += method.payload_bytes(grad)
        report.losses.append(loss.item())
        report.payload_bytes.append(sent)
    return report


def _plan(params: list[tuple[str, nn.Parameter]], budget: float) -> dict[str, Compressor]:
    menus = {name: [make() for make in ADAPTIVE_MENU] for name, _ in params}
    # relative errors, so the budget is a fraction; `or 1.0`: all-zero gradients
    norm = sum(float(p.grad.pow(2).sum()) for _, p in params) or 1.0
    errors = [[float((p.grad - c.round_trip(p.grad, name)).pow(2).sum()) / norm
               for c in menus[name]] for name, p in params]
    sizes = [[c.payload_bytes(p.grad) for c in menus[name]] for name, p in params]
    picks = torch.tensor(choose_levels(errors, sizes, budget), dtype=torch.int64,
                         device=params[0][1].device)
    collectives.broadcast(picks, src=0)  # every rank must compress each layer the same way
    return {name: menus[name][int(i)] for (name, _), i in zip(params, picks, strict=True)}
