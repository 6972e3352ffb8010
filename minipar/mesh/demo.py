"""The mesh demo: the tiny decoder trained on a DP x PP x TP mesh (and with ZeRO-1 over dp),
each rank checking its loss, gradients and parameters against one process (MoE experts over
an ep dimension are the MoE demo's: the MoE package sits above the mesh). `python -m minipar.mesh`,
`minipar tour` and the tests run `demo`."""

from __future__ import annotations

import time

from .. import collectives
from ..demo import Check, Context, Row, start_clock
from ..runtime import world_size
from .twin_check import check_against_twin


def default_dims(ranks: int) -> dict[str, int]:
    """A mesh for `ranks`: tp=2 and pp=2 where they divide, data parallelism for the rest."""
    tp = 2 if ranks % 2 == 0 else 1
    pp = 2 if (ranks // tp) % 2 == 0 else 1
    return {"dp": ranks // (tp * pp), "pp": pp, "tp": tp}


def mesh_dims(ranks: int, dp: int = 0, pp: int = 0, tp: int = 0) -> dict[str, int]:
    """The demo's mesh: `default_dims` when no degree is given, else the given ones (an
    unnamed degree is 1); their product must be `ranks`."""
    if min(dp, pp, tp) < 0:
        raise ValueError(f"--dp, --pp and --tp must be positive; got {dp}, {pp}, {tp}")
    dims = {"dp": dp or 1, "pp": pp or 1, "tp": tp or 1} if dp or pp or tp else \
        default_dims(ranks)
    if dims["dp"] * dims["pp"] * dims["tp"] != ranks:
        raise ValueError(f"--dp x --pp x --tp must equal --ranks ({ranks}); got "
                         f"{_label(dims)}")
    return dims


def check_options(ranks: int, dp: int = 0, pp: int = 0, tp: int = 0) -> None:
    """`python -m minipar.mesh`'s options, checked before any rank starts."""
    mesh_dims(ranks, dp, pp, tp)


def _label(dims: dict[str, int]) -> str:
    return " x ".join(f"{n}={s}" for n, s in dims.items())


def _check(title: str, fn, *args) -> Check:
    start = start_clock()
    with collectives.meter() as m:
        result = fn(*args)
    # float64 on both sides: a loss gap beyond 1e-12 is a bug, not rounding
    ok = result["loss_gap"] < 1e-12 and not result["wrong_grads"] and not result["wrong_params"]
    note = "2 Adam steps, float64: loss, every gradient and parameter" if ok else (
        f"differs: {(result['wrong_grads'] + result['wrong_params'])[:3]}, loss gap "
        f"{result['loss_gap']:.1e}")
    return Check(title, ok, time.perf_counter() - start, m.sent_bytes, note=note)


def demo(dp: int = 0, pp: int = 0, tp: int = 0) -> list[Check]:
    """On every rank: the decoder on a dp x pp x tp mesh (0s: `default_dims`) with Adam, then
    with ZeRO-1 over dp."""
    k = world_size()
    dims = mesh_dims(k, dp, pp, tp)
    checks = [_check(f"decoder on a mesh, {_label(dims)}, Adam", check_against_twin, dims)]
    if dims["dp"] > 1:
        checks.append(_check(f"decoder on a mesh, {_label(dims)}, ZeRO-1 over dp",
                             check_against_twin, dims, True))
    return checks


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(4, demo, 2, 1, 2) + ctx.checks(4, demo, 1, 2, 2)
