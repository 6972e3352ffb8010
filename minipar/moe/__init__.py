"""Mixture-of-Experts: routing (routing.py), the one-process layer (layer.py) and expert
parallelism with all-to-all (expert_parallel.py); with its benchmark (bench.py), lesson
05's checks (exercises.py) and its demo (demo.py, `python -m minipar.moe`).

Two extension points compose: a routing rule (rule.py's `RoutingRule`: top-k with
capacity in top_k.py, dropless.py, expert_choice.py, LSH centroids in lsh.py) and an
exchange (exchange.py's `Exchange`: the flat all-to-all there, Tutel's hierarchical one in
hierarchical.py, the chunked, pipelined one in pipelining.py);
`ExpertParallelMoE(twin, exchange=...)` routes with the twin's own rule object.

The systems papers (lesson 09): Tutel's hierarchical all-to-all, pipelined dispatch and
adaptive parallelism (adaptive.py), Pipeline MoE (pipeline_moe.py), LSH-MoE, dropless and
expert-choice routing, and the systems' schedules drawn from stated costs
(system_timelines.py). Experts over an `ep` dimension of a mesh: on_mesh.py.

The conventions (gate orders, capacity, which tokens drop, the balance and z losses)
are written once, in routing.py's docstring.
"""

from .adaptive import AdaptiveMoE
from .dropless import Dropless, DroplessMoE, padding_waste
from .exchange import Exchange, FlatAllToAll
from .expert_choice import ExpertChoice, ExpertChoiceMoE
from .expert_parallel import ExpertParallelMoE
from .hierarchical import (
    HierarchicalAllToAll,
    all_to_all_time,
    hierarchical_all_to_all,
    node_mesh,
)
from .layer import MoELayer, combine, dispatch, dispatch_combine, train_router_stats
from .lsh import LSHCentroids, LSHMoE, lsh_buckets
from .pipeline_moe import PipelineMoE
from .pipelining import ChunkedAllToAll
from .routing import GATE_ORDERS, Gate, Routing, capacity, imbalance, route
from .rule import Choices, RoutingRule
from .top_k import TopKCapacity, global_routing

__all__ = ["GATE_ORDERS", "AdaptiveMoE", "Choices", "ChunkedAllToAll", "Dropless",
           "DroplessMoE", "Exchange", "ExpertChoice", "ExpertChoiceMoE", "ExpertParallelMoE",
           "FlatAllToAll", "Gate", "HierarchicalAllToAll", "LSHCentroids", "LSHMoE",
           "MoELayer", "PipelineMoE", "Routing", "RoutingRule", "TopKCapacity",
           "all_to_all_time", "capacity", "combine", "dispatch", "dispatch_combine",
           "global_routing", "hierarchical_all_to_all", "imbalance", "lsh_buckets",
           "node_mesh", "padding_waste", "route", "train_router_stats"]
