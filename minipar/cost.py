"""Back-of-the-envelope calculators: how much compute, time and memory training takes.

Every number a lesson quotes comes out of these functions from stated inputs, so a
learner can change an input and watch the conclusion move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_YEAR = 365.25 * 24 * 3600
GB = 1e9  # decimal gigabytes, as accelerator data sheets count them

DTYPE_BYTES = {"fp64": 8.0, "fp32": 4.0, "tf32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0,
               "int8": 1.0, "int4": 0.5}
# Extra values an optimizer keeps per parameter (momentum, Adam's first and second moment).
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
RECOMPUTE = ("none", "selective", "full")


def _choice(name: str, value: str, allowed: dict | tuple) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0; got {value!r}")
    return value


def training_flops(params: float, tokens: float, flops_per_param_token: float = 6.0) -> float:
    """FLOPs to train a dense model: about 6 per parameter per token, 2 for the forward
    multiply-add and 4 for the backward (gradients for the activations and the weights)."""
    return flops_per_param_token * _positive("params", params) * _positive("tokens", tokens)


def training_time(flops: float, devices: int = 1, flops_per_device: float = 2.25e15,
                  utilization: float = 1.0) -> float:
    """Seconds to do `flops` on `devices` accelerators that each reach `utilization` of
    their peak (published large runs: 0.3-0.5), scaling perfectly over devices: the
    optimistic bound the rest of the course takes apart."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1]; got {utilization!r}")
    _positive("devices", devices)
    return _positive("flops", flops) / (devices * _positive("flops_per_device",
                                                            flops_per_device) * utilization)


def activation_bytes(layers: int, hidden: int, seq_len: int, batch: int, heads: int,
                     recompute: str = "selective", tp: int = 1,
                     sequence_parallel: bool = False) -> float:
    """Activation memory of a transformer in 16-bit on one tensor-parallel rank, after
    Korthikanti et al. (2022), per layer and sequence (s tokens, hidden h, a heads):
    nothing recomputed, s*h*(34 + 5*a*s/h) on one rank; on tp = t ranks (their Eq. 2)
    s*h*(10 + 24/t + 5*a*s/(h*t)): the attention and MLP inner tensors split, the norms'
    inputs and the dropouts (10*s*h) stay whole unless sequence parallelism splits them
    too, (34 + 5*a*s/h)*s*h/t. "selective" recomputes the attention core, dropping the
    5*a*s/h term; "full" keeps each layer's input, 2*s*h, split by sequence parallelism
    (the paper's table says 2*s*h for every layout; under it the input is the slice).
    """
    _choice("recompute", recompute, RECOMPUTE)
    _positive("tp", tp)
    s, h, t = seq_len, hidden, tp
    scores = 5 * heads * s / h  # softmax output (2 B), dropout mask (1 B) and output (2 B)
    if sequence_parallel:
        per_token = {"none": 34 + scores, "selective": 34, "full": 2}[recompute] / t
    else:
        per_token = {"none": 10 + (24 + scores) / t, "selective": 10 + 24 / t,
                     "full": 2}[recompute]
    return layers * batch * s * h * per_token


def transformer_shape(params: float, hidden_per_layer: int = 128,
                      head_dim: int = 128) -> tuple[int, int, int]:
    """(layers, hidden, heads) of a GPT-style model with about `params` parameters.

    A transformer layer holds about 12*h^2 parameters (4h^2 in attention, 8h^2 in the
    MLP), and published models keep hidden/layers near 128 (GPT-3 175B: 96 layers of
    12288; LLaMA-7B: 32 of 4096), so params = 12 * 128^2 * L^3 gives L, then h = 128*L
    rounded to whole heads.
    """
    _positive("params", params)
    layers = max(1, round((params / (12 * hidden_per_layer**2)) ** (1 / 3)))
    heads = max(1, round(hidden_per_layer * layers / head_dim))
    return layers, heads * head_dim, heads


@dataclass(frozen=True)
class MemoryBreakdown:
    """Training memory by component, in bytes."""

    params: float
    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.params

    def __str__(self) -> str:
        rows = [(name, getattr(self, name)) for name in
                ("weights", "gradients", "optimizer", "activations")] + [("total", self.total)]
        return "\n".join(f"{name:>12}: {value / GB:8.1f} GB" for name, value in rows)


def training_memory(params: float, weights: str = "bf16", grads: str = "bf16",
                    optimizer: str = "adam", optimizer_dtype: str = "fp32",
                    master_weights: str | None = None,
                    activations: float = 0.0) -> MemoryBreakdown:
    """Bytes needed to train a model of `params` parameters, by component.

    Weights and gradients take their dtype's size per parameter; the optimizer
    keeps OPTIMIZER_STATES[optimizer] values of `optimizer_dtype` per parameter,
    plus an optional full-precision `master_weights` copy (mixed precision);
    `activations` is in bytes (see `activation_bytes`).
    """
    _positive("params", params)
    for name, dtype in (("weights", weights), ("grads", grads),
                        ("optimizer_dtype", optimizer_dtype)):
        _choice(name, dtype, DTYPE_BYTES)
    _choice("optimizer", optimizer, OPTIMIZER_STATES)
    optimizer_bytes = OPTIMIZER_STATES[optimizer] * DTYPE_BYTES[optimizer_dtype]
    if master_weights is not None:
        optimizer_bytes += DTYPE_BYTES[_choice("master_weights", master_weights, DTYPE_BYTES)]
    if activations < 0:
        raise ValueError(f"activations must be >= 0 bytes; got {activations!r}")
    return MemoryBreakdown(params, params * DTYPE_BYTES[weights], params * DTYPE_BYTES[grads],
                           params * optimizer_bytes, activations)


def zero_memory(full: MemoryBreakdown, stage: int, world_size: int) -> MemoryBreakdown:
    """Per-rank memory of data parallelism on `world_size` ranks under ZeRO `stage`
    (Rajbhandari et al. 2020): stage 1 divides the optimizer state by K, stage 2 the
    gradients too, stage 3 the weights too; stage 0 is plain data parallelism. Activations
    are each rank's own and stay as given."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (plain data parallelism), 1, 2 or 3; got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    k = world_size
    return MemoryBreakdown(full.params, full.weights / (k if stage >= 3 else 1),
                           full.gradients / (k if stage >= 2 else 1),
                           full.optimizer / (k if stage >= 1 else 1), full.activations)


def largest_model(memory_bytes: float, bytes_per_param: float) -> float:
    """Parameters that fit in `memory_bytes` at a given training cost per parameter."""
    return _positive("memory_bytes", memory_bytes) / _positive("bytes_per_param", bytes_per_param)


# --- communication: the alpha-beta model ---

@dataclass(frozen=True)
class Link:
    """The one latency / bandwidth pair: one direction of a link, seconds per message and
    bytes per second. The alpha-beta model names the same pair alpha (= latency) and beta
    (= 1 / bandwidth, seconds per byte)."""

    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if not self.latency >= 0 or not self.bandwidth > 0:
            raise ValueError(f"a link needs latency >= 0 seconds and bandwidth > 0 bytes/s; "
                             f"got latency={self.latency!r}, bandwidth={self.bandwidth!r}")

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        return 1 / self.bandwidth

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class CollectiveCost:
    """What the alpha-beta model predicts for one all-reduce of `nbytes` on K ranks."""

    algorithm: str
    steps: int  # communication steps on the critical path
    seconds: float  # alpha per step + beta per byte on the critical path
    busiest_rank_bytes: float  # bytes sent by the rank that sends the most
    total_bytes: float  # bytes sent by all ranks together


def _log2_ceil(k: int) -> int:
    # ceil(log2 k) in integers: k - 1 needs that many bits (no float log to round wrong)
    return (k - 1).bit_length()


@dataclass(frozen=True)
class CommStep:
    """One communication step of a collective: `transfers` messages of `nbytes` each in
    flight at once among `ranks` busy ranks, each receiver adding `reduced` bytes."""

    transfers: int
    nbytes: float
    ranks: int
    reduced: float = 0.0


ALL_REDUCE_ALGORITHMS = ("naive", "tree", "ring", "halving_doubling")


def all_reduce_steps(algorithm: str, world_size: int, nbytes: float) -> list[CommStep]:
    """The steps minipar's all-reduce algorithms take (the one schedule of each that every
    model prices): naive, rank 0 takes each rank's N bytes in turn, then sends N to each;
    tree, a binomial reduce then broadcast; ring, a reduce-scatter then an all-gather of
    N/K chunks; halving_doubling, recursive halving then doubling among P (the largest
    power of two <= K), with one fold and one unfold step of N bytes for the others."""
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError("algorithm must be one of 'naive', 'tree', 'ring', "
                         f"'halving_doubling'; got {algorithm!r}")
    k, n = world_size, float(nbytes)
    if k < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if k == 1:
        return []
    if algorithm == "ring":
        # reduce-scatter steps add each arriving chunk; all-gather steps only copy it
        return [CommStep(k, n / k, k, n / k)] * (k - 1) + [CommStep(k, n / k, k)] * (k - 1)
    if algorithm == "naive":  # the root takes one rank at a time, then sends to each
        return [CommStep(1, n, 2, n)] * (k - 1) + [CommStep(1, n, 2)] * (k - 1)
    if algorithm == "tree":  # binomial: round i pairs ranks 2^i apart
        # round i's senders: the ranks whose lowest set bit is bit i
        rounds = [sum(1 for r in range(k) if r % (2 << i) == 1 << i)
                  for i in range(_log2_ceil(k))]
        return [CommStep(t, n, 2 * t, n) for t in rounds] \
            + [CommStep(t, n, 2 * t) for t in reversed(rounds)]
    p = 1 << (k.bit_length() - 1)  # halving_doubling: fold the extra ranks in first
    extra = k - p
    # halving step j exchanges N / 2^(j+1): half of what the pair still shares
    sizes = [n / (2 << j) for j in range((p - 1).bit_length())]
    fold = [CommStep(extra, n, 2 * extra, n)] if extra else []
    unfold = [CommStep(extra, n, 2 * extra)] if extra else []
    halving = [CommStep(p, s, p, s) for s in sizes]  # reduce-scatter: halves, each reduced
    doubling = [CommStep(p, s, p) for s in reversed(sizes)]  # all-gather: doubles back
    return fold + halving + doubling + unfold


def _busiest_rank_bytes(algorithm: str, k: int, n: float) -> float:
    """Bytes sent by the rank that sends the most (the steps count the critical path)."""
    if algorithm == "naive":
        return (k - 1) * n  # rank 0 sends N to each other rank
    if algorithm == "tree":
        return _log2_ceil(k) * n  # the root sends in every broadcast round
    if algorithm == "ring":
        return 2 * (k - 1) * n / k
    p = 1 << (k.bit_length() - 1)
    # a folded-in partner also sends its N bytes into the fold: about 3N, not 2N
    return 2 * n * (p - 1) / p + (n if k > p else 0.0)


def all_reduce_cost(algorithm: str, world_size: int, nbytes: float, alpha: float = 0.0,
                    beta: float = 0.0, gamma: float = 0.0) -> CollectiveCost:
    """Alpha-beta(-gamma) prediction for minipar's all-reduce algorithms, priced on their
    steps (`all_reduce_steps`).

    alpha: seconds per message (latency); beta: seconds per byte sent (1 / bandwidth);
    gamma: seconds per byte reduced (the additions), after Thakur, Rabenseifner and
    Gropp (2005). Bytes count what each rank sends, not what each link carries. In
    closed form: naive 2(K-1) steps of N bytes, (K-1)N through rank 0; tree 2 ceil(log2
    K) steps of N bytes; ring 2(K-1) steps of N/K bytes, 2(K-1)/K N per rank;
    halving_doubling 2 log2 P steps of halving sizes, plus a fold and an unfold of N.
    """
    steps = all_reduce_steps(algorithm, world_size, nbytes)
    critical = sum(s.nbytes for s in steps)  # along the critical path, one step at a time
    reduced = sum(s.reduced for s in steps)
    total = sum(s.transfers * s.nbytes for s in steps)  # every message of every step
    busiest = _busiest_rank_bytes(algorithm, world_size, float(nbytes)) if steps else 0.0
    return CollectiveCost(algorithm, len(steps), len(steps) * alpha + critical * beta
                          + reduced * gamma, busiest, total)


def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit t = alpha + beta * bytes to point-to-point measurements, minimizing relative error:
    plain least squares would let the large messages (milliseconds) swamp the latency
    (microseconds); weighting each point by 1/t^2 makes every size count."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("sizes and seconds must be equally long, with at least 2 points")
    if any(t <= 0 for t in seconds):
        raise ValueError("seconds must all be > 0")
    weights = [1 / t**2 for t in seconds]
    sw = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, sizes, strict=True)) / sw
    mean_y = sum(w * y for w, y in zip(weights, seconds, strict=True)) / sw
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, sizes, strict=True))
    if sxx == 0:
        raise ValueError("sizes must not all be equal")
    beta = sum(w * (x - mean_x) * (y - mean_y)
               for w, x, y in zip(weights, sizes, seconds, strict=True)) / sxx
    # clamped: noisy points can give a negative intercept, and a latency never is
    return max(mean_y - beta * mean_x, 0.0), beta


@dataclass(frozen=True)
class Traffic:
    """Bytes one step moves into (down) and out of (up) a worker and the server."""

    worker_up: float
    worker_down: float
    server_up: float
    server_down: float


def parameter_server_traffic(workers: int, model_bytes: float, grad_bytes: float) -> Traffic:
    """Each worker pushes its gradient and pulls the model; the server sees K of each."""
    return Traffic(worker_up=grad_bytes, worker_down=model_bytes,
                   server_up=workers * model_bytes, server_down=workers * grad_bytes)


def parameter_server_seconds(workers: int, model_bytes: float, grad_bytes: float,
                             link_bytes_per_second: float, full_duplex: bool = True) -> float:
    """Communication time per step when the server's link carries every push and pull: a
    full-duplex link (as every all-reduce here is priced) moves the pushes in and the pulls
    out at once; a half-duplex one, as the classic slide counts it, one after the other."""
    t = parameter_server_traffic(workers, model_bytes, grad_bytes)
    both = (max if full_duplex else sum)((t.server_up, t.server_down))
    return both / link_bytes_per_second


# --- where a transformer's FLOPs go, and what tensor parallelism sends ---

@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer's shape (ffn defaults to 4 x hidden)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab: int = 50272
    ffn: int | None = None

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def params(self) -> float:
        """Weights of the blocks and the (tied) embedding, biases and norms ignored."""
        # Q, K, V and the output projection (4 h^2), the MLP's up and down (2 h ffn)
        per_layer = 4 * self.hidden**2 + 2 * self.hidden * self.ffn_size
        return self.layers * per_layer + self.vocab * self.hidden


# GPT-3 / OPT family shapes (Brown et al. 2020, Zhang et al. 2022)
OPT_CONFIGS = {
    "760M": TransformerConfig(24, 1536, 16), "1.3B": TransformerConfig(24, 2048, 32),
    "2.7B": TransformerConfig(32, 2560, 32), "6.7B": TransformerConfig(32, 4096, 32),
    "13B": TransformerConfig(40, 5120, 40), "30B": TransformerConfig(48, 7168, 56),
    "66B": TransformerConfig(64, 9216, 72), "175B": TransformerConfig(96, 12288, 96),
}


def transformer_flops(cfg: TransformerConfig) -> dict[str, float]:
    """Training FLOPs per token by component (forward x 3: the backward costs twice the
    forward). A multiply-add counts 2. Attention scores count the full s x s products
    (QK^T and the weighted sum of V) without causal savings."""
    h, s, f = cfg.hidden, cfg.seq_len, cfg.ffn_size
    forward = {
        "attention projections": cfg.layers * 2 * 4 * h * h,  # Q, K, V and output
        "ffn": cfg.layers * 2 * 2 * h * f,
        # per token: q against s keys (s h multiply-adds), then the weighted sum of s values
        "attention scores": cfg.layers * 2 * 2 * s * h,
        "logits": 2 * h * cfg.vocab,
    }
    return {name: 3 * value for name, value in forward.items()}


def flop_shares(cfg: TransformerConfig) -> dict[str, float]:
    """Each component's share of a training step's FLOPs."""
    flops = transformer_flops(cfg)
    total = sum(flops.values())
    return {name: value / total for name, value in flops.items()}


def tensor_parallel_bytes(cfg: TransformerConfig, batch: int, tp: int,
                          bytes_per_value: int = 2) -> float:
    """Bytes each rank sends per layer and training step under Megatron tensor parallelism:
    two all-reduces of the [s, b, h] activations forward (after attention and after the
    MLP) and two backward, each a ring sending 2(t-1)/t of the tensor. Sequence
    parallelism swaps each for an all-gather plus a reduce-scatter: the same bytes."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1; got {tp}")
    activation = cfg.seq_len * batch * cfg.hidden * bytes_per_value
    return 4 * 2 * (tp - 1) / tp * activation
