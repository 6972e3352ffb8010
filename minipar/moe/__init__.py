"""Mixture-of-Experts: routing (routing.py), the one-process layer (layer.py) and expert
parallelism with all-to-all (expert_parallel.py); with its benchmark (bench.py), lesson
05's checks (exercises.py) and its demo (demo.py, `python -m minipar.moe`).

The conventions (gate orders, capacity, which tokens drop, the balance and z losses)
are written once, in routing.py's docstring.
"""

from .expert_parallel import ExpertParallelMoE, global_routing
from .layer import MoELayer, combine, dispatch, dispatch_combine, train_router_stats
from .routing import GATE_ORDERS, Gate, Routing, capacity, imbalance, route

__all__ = ["GATE_ORDERS", "ExpertParallelMoE", "Gate", "MoELayer", "Routing", "capacity",
           "combine", "dispatch", "dispatch_combine", "global_routing", "imbalance", "route",
           "train_router_stats"]
