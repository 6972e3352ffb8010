"""Mixture-of-Experts: routing (routing.py), the one-process layer (layer.py) and expert
parallelism with all-to-all (expert_parallel.py); with its benchmark (bench.py), lesson
05's checks (exercises.py) and its demo (demo.py, `python -m minipar.moe`).

The systems papers (lesson 09): Tutel's hierarchical all-to-all (hierarchical.py),
pipelined dispatch (pipelining.py) and adaptive parallelism (adaptive.py), Pipeline MoE
(pipeline_moe.py), LSH-MoE (lsh.py), dropless and expert-choice routing (variants.py;
expert-parallel through ExpertParallelMoE of such a twin), and the systems' schedules
drawn from stated costs (schedules.py).

The conventions (gate orders, capacity, which tokens drop, the balance and z losses)
are written once, in routing.py's docstring.
"""

from .adaptive import AdaptiveMoE
from .expert_parallel import ExpertParallelMoE, global_routing
from .hierarchical import all_to_all_time, hierarchical_all_to_all
from .layer import MoELayer, combine, dispatch, dispatch_combine, train_router_stats
from .lsh import LSHMoE, lsh_buckets
from .pipeline_moe import PipelineMoE
from .routing import GATE_ORDERS, Gate, Routing, capacity, imbalance, route
from .variants import DroplessMoE, ExpertChoiceMoE, padding_waste

__all__ = ["GATE_ORDERS", "AdaptiveMoE", "DroplessMoE", "ExpertChoiceMoE",
           "ExpertParallelMoE", "Gate", "LSHMoE", "MoELayer", "PipelineMoE", "Routing",
           "all_to_all_time", "capacity", "combine", "dispatch", "dispatch_combine",
           "global_routing", "hierarchical_all_to_all", "imbalance", "lsh_buckets",
           "padding_waste", "route", "train_router_stats"]
