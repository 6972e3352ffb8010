"""MASHA1 and MASHA2 (Beznosikov, Richtarik, Diskin, Ryabinin, Gasnikov, NeurIPS 2022):
extragradient whose operator travels compressed, and the naive way that fails.

Extragradient on ranks sends F_m twice per iteration, 2n numbers each (saddle.py). To send
k of them instead:

- naive: compress F_m(z) itself (`naive_extragradient`). At the saddle point the mean F
  is 0 but each rank's F_m is not (its data differs), so the compression error never
  vanishes: an unbiased Rand-k keeps kicking z about a noise floor, and a biased Top-k
  without memory settles where the mean of the *compressed* F_m is zero, not F.
- MASHA1 (their Algorithm 1): a reference point w whose full operator F(w) every rank
  knows. Each iteration looks ahead from z_bar = tau z + (1 - tau) w along -F(w) (no
  communication), and sends only the compressed *difference* Q(F_m(z+1/2) - F_m(w)),
  unbiased Rand-k. Near the solution z+1/2 and w are close, so the differences and their
  compression error shrink to 0: variance reduction. With probability p, w moves to z and
  the ranks all-reduce F(w) uncompressed (rarely: p ~ k/d).
- MASHA2 (their Algorithm 2): the same loop with a contractive Top-k and error feedback:
  each rank adds what earlier steps did not deliver before compressing (one-direction
  compression: the paper also compresses the server's reply; ranks here are peers).

Compressors and error feedback are the data-parallel ones (`data_parallel/compression.py`);
the coin that moves w is drawn from one seed on every rank, so all ranks agree without
sending a bit. Every byte counted is what `collectives.meter` saw leave this rank.
"""

from __future__ import annotations

import torch

from .. import collectives
from ..data_parallel.compression import Compressor, ErrorFeedback, RandK, TopK
from ..runtime import device
from .saddle import (
    SaddleProblem,
    SaddleRun,
    check_step,
    extragradient,
    extragradient_on_ranks,
    my_part,
)

METHODS = ("extragradient", "rand-k", "top-k", "masha1", "masha2")
# Step sizes in units of 1/L (L: the operator's Lipschitz constant), from a sweep on
# bilinear_problem's instances at k/d = 5%, p = 2k/d: extragradient's 1/(2L) is the textbook
# one; the compressed methods diverge above about 0.25/L, and 0.15/L spends the fewest bytes.
STEP = {"extragradient": 0.5, "rand-k": 0.15, "top-k": 0.15, "masha1": 0.15, "masha2": 0.15}
# iterations per method in a comparison: enough for extragradient and MASHA to pass 1e-6 x the
# start's distance, and for the naive methods to show their plateau
STEPS = {"extragradient": 80, "rand-k": 300, "top-k": 300, "masha1": 800, "masha2": 800}
LABELS = {"extragradient": "extragradient (uncompressed)",
          "rand-k": "naive extragradient, Rand-k", "top-k": "naive extragradient, Top-k",
          "masha1": "MASHA1 (Rand-k, variance reduction)",
          "masha2": "MASHA2 (Top-k, error feedback)"}


def compressor(method: str, k: int, dim: int, seed: int = 0) -> Compressor:
    """The compressor a method sends with: Rand-k (unbiased) or Top-k (contractive)."""
    if method in ("rand-k", "masha1"):
        return RandK.keeping(k, dim, seed=seed)
    if method in ("top-k", "masha2"):
        return TopK.keeping(k, dim)
    raise ValueError(f"method must be one of {', '.join(METHODS[1:])} to compress; "
                     f"got {method!r}")


def naive_extragradient(problem: SaddleProblem, method: str, gamma: float, steps: int,
                        k: int, seed: int = 0) -> SaddleRun:
    """Call on every rank: extragradient with F_m itself compressed ("rand-k": unbiased, no
    variance reduction; "top-k": no error feedback), twice per iteration."""
    check_step(gamma, steps)
    m, z_star = my_part(problem), problem.solution()
    squeeze = compressor(method, k, problem.dim, seed)

    def F(z: torch.Tensor) -> torch.Tensor:
        return squeeze.average(problem.part_operator(m, z))

    with collectives.meter() as meter:
        start = torch.zeros(problem.dim, dtype=torch.float64, device=device())
        return extragradient(F, start, gamma, steps, z_star, lambda: meter.sent_bytes, method)


def masha(problem: SaddleProblem, method: str, gamma: float, steps: int, k: int,
          p: float | None = None, tau: float | None = None, seed: int = 0) -> SaddleRun:
    """Call on every rank: MASHA1 ("masha1", Rand-k) or MASHA2 ("masha2", Top-k with error
    feedback). p: the chance per iteration that w moves to z (default k/dim, the paper's
    1/(omega + 1) for Rand-k); tau: z_bar's weight on z (default 1 - p, the paper's)."""
    check_step(gamma, steps)
    if method not in ("masha1", "masha2"):
        raise ValueError(f"method must be 'masha1' or 'masha2'; got {method!r}")
    squeeze = compressor(method, k, problem.dim, seed)
    p = k / problem.dim if p is None else p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1] (the chance that w moves each iteration); "
                         f"got {p!r}")
    tau = 1 - p if tau is None else tau
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < 1:
        raise ValueError(f"tau must be in [0, 1) (z_bar's weight on z); got {tau!r}")
    m, z_star = my_part(problem), problem.solution()
    # one seed on every rank: the ranks flip the same coin and move w together, unsent
    coin = torch.Generator().manual_seed(seed)
    feedback = ErrorFeedback() if method == "masha2" else None
    run = SaddleRun(method)
    z = w = torch.zeros(problem.dim, dtype=torch.float64, device=problem.A.device)
    with collectives.meter() as meter:
        mine_w, F_w = _full_operator(problem, m, w)
        run.distances.append(float((z - z_star).norm()))
        run.sent_bytes.append(meter.sent_bytes)
        for _ in range(steps):
            z_bar = tau * z + (1 - tau) * w
            half = z_bar - gamma * F_w  # every rank knows F(w): no communication
            delta = problem.part_operator(m, half) - mine_w
            sent = (feedback.average(squeeze, delta, "delta") if feedback is not None
                    else squeeze.average(delta))
            z = z_bar - gamma * (F_w + sent)
            # a coin flip from a CPU generator, read at once
            flip = torch.rand(1, generator=coin).item()
            if flip < p:
                w = z
                mine_w, F_w = _full_operator(problem, m, w)
            run.distances.append(float((z - z_star).norm()))
            run.sent_bytes.append(meter.sent_bytes)
    run.z = z
    return run


def _full_operator(problem: SaddleProblem, m: int,
                   w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's F_m(w) and the uncompressed mean F(w) (one all-reduce)."""
    mine = problem.part_operator(m, w)
    return mine, collectives.all_reduce(mine.clone(), op="avg")


def solve(problem: SaddleProblem, method: str, gamma: float, steps: int, k: int = 1,
          p: float | None = None, seed: int = 0) -> SaddleRun:
    """Call on every rank: one of METHODS on the problem (k, p and seed apply to the
    compressed ones)."""
    if method == "extragradient":
        return extragradient_on_ranks(problem, gamma, steps)
    if method in ("rand-k", "top-k"):
        return naive_extragradient(problem, method, gamma, steps, k, seed)
    if method in ("masha1", "masha2"):
        return masha(problem, method, gamma, steps, k, p, seed=seed)
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def compare(problem: SaddleProblem, k: int, p: float | None = None,
            methods: tuple[str, ...] = METHODS, steps: dict[str, int] | None = None,
            seed: int = 0) -> list[SaddleRun]:
    """Call on every rank: each method with its STEP (x 1/L) for STEPS iterations (or
    `steps`), one after another on the same ranks and problem."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods must be among {', '.join(METHODS)}; got {unknown}")
    gamma = 1 / problem.lipschitz()
    steps = {**STEPS, **(steps or {})}
    return [solve(problem, m, STEP[m] * gamma, steps[m], k, p, seed) for m in methods]
