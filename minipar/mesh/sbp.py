"""SBP placements (OneFlow, Yuan et al. 2021): how a logical tensor lies on the ranks of
one mesh dimension.

- `Split(d)`: rank r holds the r-th of K equal pieces along dimension d;
- `Broadcast()`: every rank holds the whole tensor;
- `Partial()`: every rank holds a tensor of the full shape, and the logical tensor is
  their sum (what a row-parallel matmul leaves before its all-reduce).

Every collective of lesson 01 is a change of placement: S->B all-gather, P->B
all-reduce, P->S reduce-scatter, S(i)->S(j) all-to-all, and B->S is a local slice.
`convert` runs the one a change needs, `conversion` names it and prices it with the
alpha-beta model. `derive` pushes placements through a chain of matmuls and element-wise
functions and inserts a conversion wherever an operation cannot take its input as it
lies: written with the MLP's weights split, it derives Megatron's one all-reduce.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .. import collectives
from ..runtime import rank, world_size


@dataclass(frozen=True)
class Split:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Broadcast:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Split | Broadcast | Partial


def placement(text: str | Placement) -> Placement:
    """'S(0)', 'S(1)', 'B' or 'P' (or a placement, returned as is)."""
    if isinstance(text, Split | Broadcast | Partial):
        return text
    t = str(text).replace(" ", "").upper()
    if t == "B":
        return Broadcast()
    if t == "P":
        return Partial()
    if t.startswith("S(") and t.endswith(")") and t[2:-1].isdigit():
        return Split(int(t[2:-1]))
    raise ValueError(f"placement must be 'S(<dim>)', 'B' or 'P'; got {text!r}")


@dataclass(frozen=True)
class Conversion:
    """The collective that turns one placement into another, and its price per rank."""

    source: Placement
    target: Placement
    collective: str  # "none", "local slice", "all_gather", "all_reduce", ...
    bytes_sent: float  # by each rank
    messages: int  # sent by each rank, ring algorithms
    seconds: float  # alpha * messages + beta * bytes_sent


def conversion(source: str | Placement, target: str | Placement, nbytes: float, ranks: int,
               alpha: float = 0.0, beta: float = 0.0) -> Conversion:
    """Which collective converts `source` to `target` for a logical tensor of `nbytes` on
    `ranks` ranks, and its alpha-beta cost (ring algorithms, as minipar's collectives)."""
    s, t, k, n = placement(source), placement(target), ranks, float(nbytes)
    # (K-1)/K: a ring passes on K-1 of the K pieces, every piece but the rank's own
    frac = (k - 1) / k
    if s == t or k == 1:
        name, sent, msgs = "none", 0.0, 0
    elif isinstance(t, Partial):  # keep the values on one rank (or in one slice), zeros elsewhere
        name, sent, msgs = "local: zeros elsewhere", 0.0, 0
    elif isinstance(s, Broadcast):  # B -> S: each rank keeps its piece
        name, sent, msgs = "local slice", 0.0, 0
    elif isinstance(s, Split) and isinstance(t, Broadcast):
        name, sent, msgs = "all_gather", frac * n, k - 1
    elif isinstance(s, Split):  # S(i) -> S(j)
        # each rank holds n / K and keeps 1/K of it: it sends (K-1)/K of its own piece
        name, sent, msgs = "all_to_all", frac * n / k, k - 1
    elif isinstance(t, Broadcast):  # P -> B
        # ring all-reduce = reduce-scatter + all-gather: twice the bytes and steps of either
        name, sent, msgs = "all_reduce", 2 * frac * n, 2 * (k - 1)
    else:  # P -> S
        name, sent, msgs = "reduce_scatter", frac * n, k - 1
    return Conversion(s, t, name, sent, msgs, alpha * msgs + beta * sent)


def _along(fn, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply a dim-0 collective along `dim`."""
    # the collectives split and join dim 0; movedim is a strided view, hence the copies
    return fn(x.movedim(dim, 0).contiguous()).movedim(0, dim).contiguous()


def convert(x: torch.Tensor, source: str | Placement, target: str | Placement,
            group=None) -> torch.Tensor:
    """This rank's part of the same logical tensor, re-placed from `source` to `target` over
    the ranks of `group` (split dimensions must divide evenly)."""
    s, t = placement(source), placement(target)
    me, k = rank(group), world_size(group)
    for p in (s, t):
        if isinstance(p, Split) and not 0 <= p.dim < x.dim():
            raise ValueError(f"{p} splits dimension {p.dim} but the tensor has {x.dim()}")
    if s == t or k == 1:
        return x
    if isinstance(t, Partial):
        if isinstance(s, Broadcast):
            # B -> P: one rank keeps the value and the others hold zeros, so the sum is the value
            return x if me == 0 else torch.zeros_like(x)
        # S -> P: each rank writes its piece at its own place in a full-size tensor of zeros
        return _along(lambda y: torch.cat([y if r == me else torch.zeros_like(y)
                                           for r in range(k)]), x, s.dim)
    if isinstance(s, Broadcast):
        _check_even(x, t.dim, k)
        return x.chunk(k, t.dim)[me].contiguous()
    if isinstance(s, Split) and isinstance(t, Broadcast):
        return _along(lambda y: collectives.all_gather(y, group=group), x, s.dim)
    if isinstance(s, Split):
        _check_even(x, t.dim, k)
        # S(i) -> S(j): cut along j, send piece r to rank r, join what arrives along i
        pieces = [p.contiguous() for p in x.chunk(k, t.dim)]
        flat = collectives.all_to_all(torch.cat([p.reshape(-1) for p in pieces]), group=group)
        return torch.cat([f.view_as(pieces[0]) for f in flat.chunk(k)], dim=s.dim)
    if isinstance(t, Broadcast):
        # the all-reduce works in place: reduce a copy, the caller's x stays its partial sum
        return collectives.all_reduce(x.clone(), group=group)
    _check_even(x, t.dim, k)
    return _along(lambda y: collectives.reduce_scatter(y, group=group), x, t.dim)


def _check_even(x: torch.Tensor, dim: int, k: int) -> None:
    if x.shape[dim] % k:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split evenly over "
                         f"{k} ranks; pad it to a multiple of {k}")


# --- pushing placements through a chain of operations ---

_MATMUL = {  # (input, weight) -> output, for y = x @ W with x [tokens, in], W [in, out]
    ("B", "B"): "B", ("B", "S(1)"): "S(1)", ("S(0)", "B"): "S(0)",
    # S(1) x S(0): each rank multiplies its slice of the shared inner dimension, a partial
    # sum; a partial sum times anything whole stays partial, as the matmul is linear
    ("S(1)", "S(0)"): "P", ("P", "B"): "P", ("B", "P"): "P",
}


@dataclass(frozen=True)
class ChainStep:
    """One operation of a derived chain: what it takes, what it gives, and any conversion
    inserted before it to make its input acceptable."""

    op: str
    before: Conversion | None
    output: Placement


def derive(ops: list[tuple], x: str = "B", out: str = "B", nbytes: float = 1.0,
           ranks: int = 2, alpha: float = 0.0, beta: float = 1.0) -> list[ChainStep]:
    """Placements through `ops`, each ("matmul", weight placement[, output width / input
    width]) or ("elementwise", ""); a matmul whose input cannot meet its weight is preceded
    by the cheapest conversion of its input that can; an element-wise function (gelu)
    cannot take a partial sum, which is first reduced; the chain ends converted to `out`.
    Costs are for an input activation of `nbytes` on `ranks` ranks."""
    here, steps = str(placement(x)), []
    for op, weight, *scale in ops:
        before = None
        if op == "matmul":
            w = str(placement(weight))
            options = [p for p in ("B", "S(0)", "S(1)", "P") if (p, w) in _MATMUL]
            if not options:
                raise ValueError(f"no input placement can meet a weight placed {w}")
            if (here, w) not in _MATMUL:
                best = min(options, key=lambda p: conversion(here, p, nbytes, ranks, alpha,
                                                             beta).seconds)
                before, here = conversion(here, best, nbytes, ranks, alpha, beta), best
            here = _MATMUL[(here, w)]
            # later conversions price this matmul's output, which may be wider or narrower
            nbytes *= scale[0] if scale else 1.0
        elif op == "elementwise":
            # gelu(a + b) != gelu(a) + gelu(b): a nonlinear function needs the sum itself
            if here == "P":
                before, here = conversion("P", "B", nbytes, ranks, alpha, beta), "B"
        else:
            raise ValueError(f"op must be 'matmul' or 'elementwise'; got {op!r}")
        steps.append(ChainStep(f"{op} {weight}".strip(), before, placement(here)))
    if here != str(placement(out)):
        last = conversion(here, out, nbytes, ranks, alpha, beta)
        steps.append(ChainStep(f"to {placement(out)}", last, placement(out)))
    return steps


def chain_cost(steps: list[ChainStep]) -> float:
    return sum(s.before.seconds for s in steps if s.before is not None)


def mlp_placements(ranks: int = 2, nbytes: float = 1.0) -> list[tuple[str, str, float, str]]:
    """Every way to split both MLP weights (up [h, 4h], down [4h, h]) over `ranks`, with the
    chain `derive` finds for x: B -> up -> gelu -> down -> B (x of `nbytes`, the hidden
    activation 4x that), cheapest first: (up, down, seconds at beta = 1 s/byte, the
    collectives). Megatron's column-then-row split comes first."""
    rows = []
    for up, down in itertools.product(("S(0)", "S(1)"), repeat=2):
        steps = derive([("matmul", up, 4.0), ("elementwise", ""), ("matmul", down, 0.25)],
                       nbytes=nbytes, ranks=ranks)
        used = [s.before.collective for s in steps if s.before is not None
                and s.before.collective != "none"]
        rows.append((up, down, chain_cost(steps), ", ".join(used) or "none"))
    return sorted(rows, key=lambda r: r[2])


def run_chain(x: torch.Tensor, weights: list[torch.Tensor], steps: list[ChainStep],
              group=None) -> torch.Tensor:
    """Execute a chain from `derive` on real ranks: `x` placed as the chain's input,
    `weights` the full matrices of its matmuls (each rank keeps its own piece), every
    inserted conversion run by `convert`. Returns this rank's part of the output."""
    me, k = rank(group), world_size(group)
    weights = list(weights)
    for step in steps:
        if step.before is not None:
            x = convert(x, step.before.source, step.before.target, group)
        if step.op.startswith("matmul"):
            w = weights.pop(0)
            where = placement(step.op.split()[1])
            if isinstance(where, Split):
                w = w.chunk(k, where.dim)[me]
            elif isinstance(where, Partial):
                raise ValueError("run_chain keeps weights whole or split, not partial sums")
            x = x @ w
        elif step.op == "elementwise":
            x = torch.nn.functional.gelu(x)
    return x
