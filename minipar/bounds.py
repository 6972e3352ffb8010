"""Where each strategy turns communication-bound: closed forms built on `cost`'s pieces.

A strategy is compute-bound while the arithmetic of a step takes longer than the bytes
it must move; past a threshold the link sets the pace. These functions give that
threshold in the units a practitioner controls (message size, tokens per rank, ranks),
in the manner of the JAX scaling book's rooflines, and each lesson holds them against a
run: the bytes against minipar's meter, the times against the fitted machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Link, all_reduce_cost


def _parts(algorithm: str, world_size: int, link: Link) -> tuple[float, float]:
    """An all-reduce's time as (latency part, seconds per byte): both terms are linear."""
    return (all_reduce_cost(algorithm, world_size, 1.0, alpha=link.alpha).seconds,
            all_reduce_cost(algorithm, world_size, 1.0, beta=link.beta).seconds)


def half_bandwidth_bytes(algorithm: str, world_size: int, link: Link) -> float:
    """Hockney's n_1/2 for an all-reduce: the size N at which its latency terms (steps x
    alpha) equal its byte terms. Below it latency dominates; at it the collective reaches
    half its peak bus bandwidth. The ring's is K alpha/beta (2(K-1) alphas against
    2(K-1)/K N betas), the tree's alpha/beta: the ring needs K times larger messages."""
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to communicate; got {world_size}")
    latency, per_byte = _parts(algorithm, world_size, link)
    return latency / per_byte


def crossover_bytes(algorithm: str, other: str, world_size: int, link: Link) -> float:
    """The size N at which `algorithm` and `other` take equally long (both times are a
    latency part plus a part linear in N); inf if their byte parts are equal. Not n_1/2:
    the ring overtakes the tree well before it reaches half its own peak."""
    (lat_a, byte_a), (lat_b, byte_b) = (_parts(algorithm, world_size, link),
                                        _parts(other, world_size, link))
    if byte_a == byte_b:
        return float("inf")
    return (lat_a - lat_b) / (byte_b - byte_a)


ZERO_STAGES = (0, 1, 2, 3)  # 0: plain data parallelism


def sync_bytes_per_rank(stage: int, world_size: int, param_bytes: float) -> float:
    """Bytes each rank sends per step to keep K data-parallel replicas in step, on a ring:
    plain data parallelism and ZeRO-1/2 send a reduce-scatter plus an all-gather of the
    gradients, 2(K-1)/K x P; ZeRO-3 gathers the weights again for backward, 3(K-1)/K x P,
    the 1.5x of Rajbhandari et al. (2020)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of 0 (plain data parallelism), 1, 2, 3; got {stage!r}")
    halves = 3 if stage == 3 else 2  # reduce-scatter + all-gather (+ a second all-gather)
    return halves * (world_size - 1) / world_size * param_bytes


@dataclass(frozen=True)
class StepBalance:
    """One data-parallel step's compute and communication, each alone, in seconds."""

    compute: float
    communication: float

    @property
    def ratio(self) -> float:
        """Compute over communication: above 1 a perfect overlap hides every byte."""
        return self.compute / self.communication


def data_parallel_balance(params: float, tokens_per_rank: float, world_size: int, link: Link,
                          flops_per_second: float, stage: int = 0,
                          bytes_per_value: float = 2.0,
                          flops_per_param_token: float = 6.0) -> StepBalance:
    """A step's 6 P T / F seconds of compute against its ring synchronisation (alpha per
    step, `sync_bytes_per_rank` at beta). The compute grows with the tokens per rank, the
    communication does not: the batch per rank is what decides."""
    for name, value in (("tokens_per_rank", tokens_per_rank), ("flops_per_second",
                                                              flops_per_second)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0; got {value!r}")
    compute = flops_per_param_token * params * tokens_per_rank / flops_per_second
    steps = (3 if stage == 3 else 2) * (world_size - 1)
    nbytes = sync_bytes_per_rank(stage, world_size, params * bytes_per_value)
    return StepBalance(compute, steps * link.alpha + nbytes * link.beta)


def critical_tokens_per_rank(params: float, world_size: int, link: Link,
                             flops_per_second: float, stage: int = 0,
                             bytes_per_value: float = 2.0,
                             flops_per_param_token: float = 6.0) -> float:
    """The tokens per rank at which compute equals communication. For large models,
    (2(K-1)/K) s F / (6 B) with s bytes per value: about (2/3) F/B for bf16, F/B for
    ZeRO-3. Fewer tokens per rank and no overlap can hide the link."""
    one = data_parallel_balance(params, 1.0, world_size, link, flops_per_second, stage,
                                bytes_per_value, flops_per_param_token)
    return one.communication / one.compute  # compute is linear in tokens, comm constant


CONTEXT_METHODS = ("ring", "ulysses")


def context_parallel_bytes(method: str, world_size: int, q_bytes: float,
                           kv_bytes: float) -> float:
    """Bytes each rank sends for one attention's forward and backward when K ranks split
    the sequence; q_bytes and kv_bytes are the whole sequence's q and one of k, v.

    Ring: k and v travel K-1 hops forward and again backward, and dk, dv travel K hops
    home: (2(K-1) + 2(K-1) + 2K) slices of kv/K, about 6 kv whatever K is. Ulysses: four
    all-to-alls forward (q, k, v in, the output back) and four backward, each sending
    (K-1)/K of a rank's slice: 2(K-1)/K^2 (2q + 2kv), which falls as 1/K."""
    if method not in CONTEXT_METHODS:
        raise ValueError(f"method must be one of 'ring', 'ulysses'; got {method!r}")
    k = world_size
    if method == "ring":
        return (6 * k - 4) * kv_bytes / k
    return 2 * (k - 1) / k**2 * (2 * q_bytes + 2 * kv_bytes)
