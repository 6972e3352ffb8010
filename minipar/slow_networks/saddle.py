"""A distributed bilinear saddle-point problem and extragradient, its uncompressed solver.

A saddle-point problem asks for a point where no player gains by moving alone: x
minimizes, y maximizes (a GAN's generator and discriminator, a model and its adversary).
Its gradient field F(z) = [grad_x f; -grad_y f], z = (x, y), is the operator of a
variational inequality: find z* with F(z*) = 0 here (no constraints). The test bed of
Beznosikov et al. (NeurIPS 2022), with the data split over M ranks:

    min_x max_y  1/M sum_m [ x^T A_m y + lam/2 |x|^2 - lam/2 |y|^2 + b_m^T x - c_m^T y ]

so F = mean of the ranks' F_m(z) = [A_m y + lam x + b_m;  -A_m^T x + lam y + c_m], a linear
map B z + q. B's symmetric part is lam I: F is lam-strongly monotone, and its Lipschitz
constant is sqrt(lam^2 + s_max(A)^2). The saddle point solves B z = -q in one process.

Plain gradient descent-ascent z <- z - gamma F(z) spirals out on a bilinear problem (the
rotation part of B has eigenvalues +-i s, so |1 - i gamma s| > 1); extragradient
(Korpelevich 1976) first looks ahead, z+1/2 = z - gamma F(z), then steps from z with the
look-ahead's operator, z <- z - gamma F(z+1/2), which spirals in (`spiral`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import collectives
from ..runtime import device, rank, world_size


@dataclass
class SaddleProblem:
    """Each part m's data (A[m], b[m], c[m]) and the regularizer lam; x and y have n entries."""

    A: torch.Tensor  # (M, n, n)
    b: torch.Tensor  # (M, n)
    c: torch.Tensor  # (M, n)
    lam: float

    @property
    def parts(self) -> int:
        return self.A.shape[0]

    @property
    def dim(self) -> int:
        """Entries of z = (x, y): what one operator evaluation sends uncompressed."""
        return 2 * self.A.shape[1]

    def part_operator(self, m: int, z: torch.Tensor) -> torch.Tensor:
        """F_m(z): part m's gradient field (descent in x, ascent in y)."""
        n = self.A.shape[1]
        x, y = z[:n], z[n:]
        return torch.cat([self.A[m] @ y + self.lam * x + self.b[m],
                          -self.A[m].t() @ x + self.lam * y + self.c[m]])

    def operator(self, z: torch.Tensor) -> torch.Tensor:
        """F(z), the mean of every part's operator (what the ranks' average computes)."""
        return torch.stack([self.part_operator(m, z) for m in range(self.parts)]).mean(0)

    def matrix(self) -> torch.Tensor:
        """B with F(z) = B z + q."""
        n, A = self.A.shape[1], self.A.mean(0)
        eye = self.lam * torch.eye(n, dtype=A.dtype, device=A.device)
        return torch.cat([torch.cat([eye, A], 1), torch.cat([-A.t(), eye], 1)])

    def solution(self) -> torch.Tensor:
        """The saddle point z*: B z* = -q, one linear solve."""
        q = torch.cat([self.b.mean(0), self.c.mean(0)])
        return torch.linalg.solve(self.matrix(), -q)

    def lipschitz(self) -> float:
        """L = |B|_2: F(z) - F(z') = B (z - z')."""
        return float(torch.linalg.matrix_norm(self.matrix(), ord=2))


def bilinear_problem(n: int = 50, parts: int = 4, lam: float = 1.0, spread: float = 1.0,
                     seed: int = 0) -> SaddleProblem:
    """A random instance: a shared A plus each part's own perturbation, and offsets b_m, c_m
    that differ by `spread` from part to part (so F_m(z*) != 0: heterogeneous data, the case
    where naive compression stalls). float64."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1 (entries of x and of y); got {n!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1; got {parts!r}")
    if not lam > 0:
        raise ValueError(f"lam must be > 0 (the strong monotonicity); got {lam!r}")
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        # the same seeded problem on any device
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device())

    # 1/sqrt(n): singular values of order 1 whatever n is
    shared = randn(n, n) / n ** 0.5
    A = shared + 0.5 * randn(parts, n, n) / n ** 0.5
    b = randn(n) + spread * randn(parts, n)
    c = randn(n) + spread * randn(parts, n)
    return SaddleProblem(A, b, c, lam)


@dataclass
class SaddleRun:
    """One solver's path: after each iteration, the distance |z - z*| and this rank's
    cumulative sent bytes as the meter counted them (the start's communication included)."""

    method: str
    distances: list[float] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)
    z: torch.Tensor | None = None

    def bytes_to_reach(self, tolerance: float) -> int | None:
        """Bytes sent when |z - z*| first fell to `tolerance` x the start's distance (None:
        never)."""
        goal = tolerance * self.distances[0]
        return next((b for d, b in zip(self.distances, self.sent_bytes, strict=True)
                     if d <= goal), None)


def check_step(gamma: float, steps: int) -> None:
    """One line for a step size or an iteration count no solver can use."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
        raise ValueError(f"gamma must be a step size > 0; got {gamma!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1; got {steps!r}")


def extragradient(F: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, gamma: float,
                  steps: int, z_star: torch.Tensor, sent: Callable[[], int] = lambda: 0,
                  method: str = "extragradient") -> SaddleRun:
    """Korpelevich's extragradient: look ahead along -F(z), step from z along -F(look-ahead).
    `F` is the whole operator (one process) or this rank's part averaged over the ranks."""
    check_step(gamma, steps)
    run = SaddleRun(method)
    run.distances.append(float((z - z_star).norm()))
    run.sent_bytes.append(sent())
    for _ in range(steps):
        half = z - gamma * F(z)
        z = z - gamma * F(half)
        run.distances.append(float((z - z_star).norm()))
        run.sent_bytes.append(sent())
    run.z = z
    return run


def my_part(problem: SaddleProblem) -> int:
    """The part this rank holds: one part per rank."""
    if problem.parts != world_size():
        raise ValueError(f"the problem has {problem.parts} parts but there are "
                         f"{world_size()} ranks; build it with parts={world_size()}")
    return rank()


def extragradient_on_ranks(problem: SaddleProblem, gamma: float, steps: int) -> SaddleRun:
    """Call on every rank: rank m evaluates F_m, an uncompressed all-reduce averages it (two
    per iteration, each 2n float64 entries)."""
    check_step(gamma, steps)
    m, z_star = my_part(problem), problem.solution()

    def F(z: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(problem.part_operator(m, z), op="avg")

    with collectives.meter() as meter:
        z0 = torch.zeros(problem.dim, dtype=torch.float64, device=problem.A.device)
        return extragradient(F, z0, gamma, steps, z_star, lambda: meter.sent_bytes)


def spiral(method: str, gamma: float = 0.2, steps: int = 60) -> torch.Tensor:
    """The path of gradient descent-ascent ("gda") or extragradient ("eg") on f = x y from
    (1, 1): the saddle is (0, 0). Rows are (x, y) after each step."""
    if method not in ("gda", "eg"):
        raise ValueError(f"method must be 'gda' or 'eg'; got {method!r}")
    check_step(gamma, steps)

    def F(z: torch.Tensor) -> torch.Tensor:
        return torch.stack([z[1], -z[0]])  # [df/dx, -df/dy] for f = x y

    z, path = torch.ones(2, dtype=torch.float64), []
    for _ in range(steps):
        z = z - gamma * F(z - gamma * F(z)) if method == "eg" else z - gamma * F(z)
        path.append(z)
    return torch.stack([torch.ones(2, dtype=torch.float64), *path])
