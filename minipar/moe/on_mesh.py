"""Experts on a mesh: expert parallelism over an `ep` dimension inside data parallelism.
The MoE composition sits above the mesh (moe imports mesh, never the reverse).

On `Mesh(dp=2, ep=2)` the two ranks of an ep group split the experts between them and
exchange tokens by all-to-all; the two ep groups are data-parallel replicas. Gradients
then meet in two ways, as DeepSpeed-MoE and Megatron-LM arrange them, through the one
data parallelism the trainer uses too (`mesh.StageDataParallel`: lesson 02's DDP, inside
backward):

- the dense parameters (the gate, a shared expert) are on every rank: averaged over all
  ranks, as plain data parallelism does;
- an expert lives on one rank of each ep group: averaged over `dp` only. Its gradient
  already sums what the tokens of every rank of its ep group asked of it, each rank's
  loss a mean over its own tokens; to be the mean over all ranks' tokens, it is divided
  by the ep size as well (a hook, before it is added into .grad).

Capacity is counted per ep group (the tokens that meet in one all-to-all), so the
one-process reference runs the layer once per dp replica on that replica's tokens.
"""

from __future__ import annotations

import torch

from .. import collectives
from ..mesh import Mesh
from ..mesh.stage_data_parallel import StageDataParallel
from ..runtime import device, rank
from .expert_parallel import ExpertParallelMoE, average_experts_over_ep
from .layer import MoELayer

_HIDDEN, _TOKENS = 8, 6  # per rank


def _twin(seed: int) -> MoELayer:
    # seeded on the host, then moved: the same layer on any device
    twin = MoELayer(_HIDDEN, 16, num_experts=4, k=2, capacity_factor=1.0,
                    shared_expert=True, seed=seed, dtype=torch.float64)
    return twin.to(device())


def _batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + r)
    # the same seeded batch on any device
    x, y = (torch.randn(_TOKENS, _HIDDEN, generator=gen, dtype=torch.float64)
            for _ in range(2))
    return x.to(device()), y.to(device())


def _loss(layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x + layer(x) - y) ** 2).mean()


def data_parallel(layer: ExpertParallelMoE, dp_group, ep_size: int) -> StageDataParallel:
    """Dense parameters: mean over every rank. Experts: mean over dp (`dp_group`), each
    gradient divided by ep first. Its hooks do both inside backward."""
    experts = list(layer.experts.parameters())
    average_experts_over_ep(experts, ep_size)
    # DeepSpeed-MoE / Megatron: replicated parameters average over every rank
    return StageDataParallel({0: layer}, 0, None, None,
                             groups={id(p): dp_group for p in experts})


def check_moe_against_twin(mesh_dims: dict[str, int], steps: int = 2, seed: int = 5) -> dict:
    """Run on every rank of a launched mesh with an `ep` dimension (and optionally `dp`):
    train an expert-parallel MoE layer for `steps` Adam steps, and the one-process layer
    beside it on every replica's tokens; return the loss gap and the names of gradients
    (first step) and parameters (after the last) that differ from the twin's."""
    if "ep" not in mesh_dims or set(mesh_dims) - {"dp", "ep"}:
        raise ValueError(f"mesh_dims must name ep (and may name dp); got {mesh_dims}")
    # no dp named: one replica (a dimension of 1); named, in the caller's order
    mesh = Mesh(**mesh_dims) if "dp" in mesh_dims else Mesh(dp=1, **mesh_dims)
    groups = mesh.connect()
    ep_size, me = mesh["ep"], rank()
    layer = ExpertParallelMoE(_twin(seed), groups.ep)
    twin = _twin(seed)
    data_parallel(layer, groups.dp, ep_size)  # its hooks average inside backward
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    reference = torch.optim.Adam(twin.parameters(), lr=1e-2)
    first = rank(groups.ep) * layer.per_rank  # this rank's experts in the twin's numbering
    mine = {f"experts.{i}.": f"experts.{first + i}." for i in range(layer.per_rank)}

    def twin_name(name: str) -> str:
        return next((name.replace(a, b, 1) for a, b in mine.items() if name.startswith(a)),
                    name)

    twin_params = dict(twin.named_parameters())
    gap, wrong_grads = 0.0, []
    for step in range(steps):
        x, y = _batch(step, me)
        loss = _loss(layer, x, y)
        loss.backward()
        run_loss = collectives.all_reduce(loss.detach().reshape(1), op="avg").item()
        ref_loss = 0.0
        for ep_ranks in mesh.groups("ep"):  # each replica's tokens meet in one layer call
            batches = [_batch(step, r) for r in ep_ranks]
            xs, ys = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            part = _loss(twin, xs, ys) * len(ep_ranks) / mesh.size
            part.backward()
            ref_loss += part.item()
        gap = max(gap, abs(run_loss - ref_loss))
        if step == 0:
            wrong_grads = [n for n, p in layer.named_parameters() if not torch.allclose(
                p.grad, twin_params[twin_name(n)].grad, rtol=1e-9, atol=1e-12)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.step()
        reference.zero_grad(set_to_none=True)
    # after Adam, rounding can reach ~1e-12 (see gpt.check_against_twin); mistakes ~lr
    wrong_params = [n for n, p in layer.named_parameters() if not torch.allclose(
        p.detach(), twin_params[twin_name(n)].detach(), rtol=1e-9, atol=1e-10)]
    return {"coords": groups.coords, "loss_gap": gap, "wrong_grads": wrong_grads,
            "wrong_params": wrong_params, "experts": [first + i for i in range(layer.per_rank)]}
