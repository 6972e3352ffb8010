"""`minipar bench moe`'s adaptive-parallelism table: 2 experts on 4 ranks (each expert split
over 2), forward + backward at every degree for a growing number of routed rows, the
measured fastest beside the alpha-beta model's pick (alpha, beta fitted on the same
cluster first)."""

from __future__ import annotations

import torch

from ..collectives import fit_machine
from ..report import format_table, progress
from ..runtime import Cluster, device, rank
from .adaptive import AdaptiveMoE, degree_costs, time_degrees
from .layer import MoELayer

SHAPE = dict(hidden=128, ffn=1024, experts=2, k=1)
NAMES = {0: "r=0 (weights move)", 1: "r=1 (EP + data)", 2: "r=2 (EP + tensor)"}


def _degrees(tokens: int, alpha: float, beta: float, repeats: int) -> dict:
    """On one rank: measured seconds per degree, and the model's costs for this capacity."""
    # seeded on the host, then moved: the same layer on any device
    twin = MoELayer(SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"], SHAPE["k"],
                    capacity_factor=1.25)
    x = torch.randn(tokens, SHAPE["hidden"], generator=torch.Generator().manual_seed(rank()))
    layer, x = AdaptiveMoE(twin.to(device()), alpha=alpha, beta=beta), x.to(device())
    measured = time_degrees(layer, x, repeats)
    capacity = layer.last_routing.capacity
    modelled = degree_costs(SHAPE["experts"] * capacity / 4, SHAPE["hidden"], SHAPE["ffn"],
                            SHAPE["experts"], 4, alpha, beta)
    with torch.no_grad():
        layer(x, "auto")
    return {"measured": measured, "modelled": modelled, "auto": layer.last_degree}


def measure_adaptive(tokens_per_rank: tuple[int, ...] = (16, 256, 4096), repeats: int = 3
                     ) -> list[dict]:
    """For each tokens-per-rank: seconds per degree, the fastest, and the model's pick."""
    rows = []
    with Cluster(4, backend="gloo") as four:
        progress("adaptive parallelism: fitting alpha, beta")
        fitted = fit_machine(four, save=False)
        alpha, beta = fitted.alpha, fitted.beta
        for tokens in tokens_per_rank:
            progress(f"adaptive parallelism, {tokens} tokens per rank")
            result = four.run(_degrees, tokens, alpha, beta, repeats)[0]
            measured, modelled = result["measured"], result["modelled"]
            rows.append({"tokens_per_rank": tokens, "alpha": alpha, "beta": beta,
                         "measured_s": measured, "modelled_s": modelled,
                         "fastest": min(measured, key=measured.get),
                         "model_pick": result["auto"]})
    return rows


def report_adaptive(rows: list[dict]) -> str:
    """Measured ms per degree, the fastest, and the model's pick, per tokens per rank."""
    shown = []
    for r in rows:
        measured = r["measured_s"]
        row = {"tokens": r["tokens_per_rank"], "fastest": NAMES[r["fastest"]],
               "pick": NAMES[r["model_pick"]],
               "cost": f"{measured[r['model_pick']] / measured[r['fastest']]:.2f}x"}
        row |= {f"d{d}": f"{s * 1e3:.1f} ms" for d, s in measured.items()}
        shown.append(row)
    degrees = sorted(rows[0]["measured_s"]) if rows else []
    table = format_table(shown, [("tokens", "tokens per rank"),
                                 *[(f"d{d}", NAMES[d]) for d in degrees],
                                 ("fastest", "measured fastest"), ("pick", "model's pick"),
                                 ("cost", "pick's time / fastest's")])
    fitted = (f" (alpha {rows[0]['alpha'] * 1e6:.0f} us, "
              f"beta {1 / rows[0]['beta'] / 1e9:.2f} GB/s fitted)") if rows else ""
    return (f"Tutel's adaptive parallelism: {SHAPE} on 4 ranks, forward + backward per degree"
            f"{fitted}\n" + table)
