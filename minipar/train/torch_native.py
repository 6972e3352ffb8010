"""The trainer's run composed from torch's own pieces, as torchtitan composes it: FSDP2
`fully_shard` over dp, DTensor `parallelize_module` (ColwiseParallel / RowwiseParallel)
over tp, `torch.distributed.pipelining` over pp. The same decoder from the same seed, the
same global batches (the trainer's sampler), the same AdamW, schedule and clipping: an
outside implementation that must reach minipar's losses (tests/test_train_race.py) and
that minipar races (torch_race.py).

What torch leaves to its user is written here, as torchtitan writes it:
- the tied embedding across pipeline stages (torch's pipelining has no tied weights):
  one all-reduce of its gradient between the two ends, as Megatron sums it;
- the global gradient norm over parameters that live on different meshes: torch's
  `get_total_norm` per mesh, each made whole with `full_tensor()`, then summed over the
  pipeline's stages.
A V-shaped pipeline (`zb_v`, `dualpipev`: torch's `ScheduleZBVZeroBubble`,
`ScheduleDualPipeV`) holds two stages per rank, stage r and stage 2p - 1 - r, so the
embedding and the head share rank 0. There the head gets its own copy of the tied
weight, and the two gradients are summed after backward as the ends' are across ranks:
torch's split backward, given one Parameter in two stages of a rank, kept only one
stage's share of its gradient (norm 0.74 where the sum's is 2.17, in float64).
Compositions it does not build here: pp with dp or tp, cp, ep, sequence parallelism,
the other multi-stage schedules.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch import nn

from ..decoder import Decoder, cross_entropy, decoder, rope_tables
from ..runtime import calm_from_birth, device, rank, world_size
from .config import TrainConfig
from .model_part import decays
from .precision import PARAM_DTYPES

# the projections each block splits over tp, as Megatron: the inputs' projections by
# columns (each rank a slice of heads or of the feed-forward's width), the outputs' by rows
TP_PLAN = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
           "attn.o_proj": "rowwise", "mlp.gate": "colwise", "mlp.up": "colwise",
           "mlp.down": "rowwise"}


# minipar's schedule name -> torch.distributed.pipelining's class of the same schedule
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "zb_v": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def refuse_native(config: TrainConfig) -> None:
    """One line for a layout this file does not compose with torch's pieces."""
    p = config.parallel
    if p.cp > 1 or p.ep > 1 or p.sequence_parallel or config.model.experts:
        raise ValueError("the torch composition covers dp (FSDP2), tp (DTensor) and pp "
                         "(pipelining): use cp = ep = 1, sequence_parallel = false and "
                         "model.experts = 0")
    if p.pp > 1 and (p.dp > 1 or p.tp > 1):
        raise ValueError(f"the torch composition runs pp={p.pp} alone: use dp = tp = 1 with it")
    if p.pp > 1 and p.schedule not in TORCH_SCHEDULES:
        raise ValueError(f"parallel.schedule={p.schedule!r}: the torch composition runs "
                         f"{', '.join(map(repr, TORCH_SCHEDULES))}")
    if config.train.precision not in ("fp32", "fp64") or config.train.accumulation != 1:
        raise ValueError("the torch composition runs fp32 or fp64 without accumulation: set "
                         "train.precision to 'fp32' or 'fp64' and train.accumulation = 1")
    if world_size() != p.dp * p.tp * p.pp:
        raise ValueError(f"dp x tp x pp = {p.dp * p.tp * p.pp} but {world_size()} ranks run: "
                         "launch that many")


class PipelineStageModule(nn.Module):
    """One pipeline stage of the decoder as torch's pipelining wants it: a module whose
    forward takes the previous stage's output (the first stage: token ids) and computes
    its own rotary tables."""

    def __init__(self, model: Decoder, first: int, last: int) -> None:
        super().__init__()
        self.config, n = model.config, model.config.layers
        self.embed = model.embed if first == 0 else None
        self.blocks = nn.ModuleList(model.blocks[first:last])
        self.norm = model.norm if last == n else None
        self.head = model.head if last == n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_tables(self.config.head_dim, positions, self.config.rope_base, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x if self.head is None else self.head(self.norm(x))


class NativeRun:
    """This rank's part of the run under torch's pieces; `step` is one optimizer step."""

    def __init__(self, config: TrainConfig) -> None:
        refuse_native(config)
        self.config, p = config, config.parallel
        model = decoder(config.model, config.train.seed,
                        PARAM_DTYPES[config.train.precision]).to(device())
        self.dp_rank, self.dp, self.twin = 0, p.dp, model
        # the race's two sides alike: torch's groups' gloo threads calm as minipar's are
        with calm_from_birth():
            if p.pp > 1:
                self._pipeline(model)
            else:
                self._fsdp_and_tp(model)
        # the twin's names, read after wrapping (FSDP2 and DTensor replace the Parameters,
        # keeping their names; a stage shares the twin's, and lists the tied one as head)
        names = {id(q): name for name, q in model.named_parameters()}
        # the tied head on the last stage is the embedding: counted in the norm once
        self.norm_params = [q for q in self.params if not (self.tied_copy and q is self.tied)
                            and q is not self.head_copy]
        if self.head_copy is not None:  # named as the weight it copies
            names[id(self.head_copy)] = names[id(self.tied)]
        o = config.optim
        groups = [[q for q in self.params if decays(names[id(q)], q) == d] for d in (True, False)]
        self.optimizer = torch.optim.AdamW(
            [{"params": groups[0], "weight_decay": o.weight_decay},
             {"params": groups[1], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)

    def _fsdp_and_tp(self, model: Decoder) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        p = self.config.parallel
        # DTensor caches each op's output sharding by mesh (in C++, and in Python where C++
        # cannot make the key), and a mesh compares equal by its layout: the previous run's
        # mesh on the same Cluster, whose groups were destroyed as this run started, would
        # come back from the cache and its groups be looked up by name ("could not resolve
        # the process group": every second race round failed)
        torch._C._clear_DTensor_sharding_propagator_cache()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        # dp outer, tp inner (tp ranks adjacent), as minipar's Mesh orders them
        mesh = init_device_mesh(device().type, (p.dp, p.tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank = mesh.get_local_rank("dp")
        # on the 2-D mesh DTensor warns that making the norm whole takes one all-reduce per
        # dimension; for one number per step that costs nothing (torchtitan flattens the mesh)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        if p.tp > 1:
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            for block in model.blocks:
                parallelize_module(block, mesh["tp"],
                                   {name: styles[s]() for name, s in TP_PLAN.items()})
        if p.dp > 1:  # torchtitan's units: each block, then the root (embedding, norm, head)
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        self.model, self.stage = model, None
        self.params = list(model.parameters())
        self.tied, self.tied_copy, self.tied_apart, self.pp_group = None, False, False, None
        self.head_copy = None

    def _pipeline(self, model: Decoder) -> None:
        from torch.distributed import pipelining

        p, n = self.config.parallel, self.config.model.layers
        r, stages = rank(), p.pp * p.virtual
        cuts = [round(i * n / stages) for i in range(stages + 1)]  # equal blocks per stage
        # a V's second stage on rank r comes back up: 2p - 1 - r (the last stage on rank 0)
        mine = (r,) if p.virtual == 1 else (r, 2 * p.pp - 1 - r)
        modules = [PipelineStageModule(model, cuts[i], cuts[i + 1]) for i in mine]
        self.first, self.last = 0 in mine, stages - 1 in mine
        tied = self.config.model.tied and (self.first or self.last)
        self.head_copy = None
        if tied and self.first and self.last:  # a V's rank 0: the head's own copy
            # the two copies stay equal: they start equal, get the same summed gradient
            # (forward_backward) and AdamW updates them element by element alike
            modules[-1].head = copy.deepcopy(model.head)
            self.head_copy = modules[-1].head.weight
        built = [pipelining.PipelineStage(modules[k], i, stages, device())
                 for k, i in enumerate(mine)]
        schedule = getattr(pipelining, TORCH_SCHEDULES[p.schedule])
        # scale_grads: each micro-batch's mean loss / m, so the step's is the batch's mean
        self.stage = schedule(built if p.virtual > 1 else built[0], p.microbatches,
                              loss_fn=cross_entropy, scale_grads=True)
        self.model = modules[0]
        self.params = [q for m in modules for q in m.parameters()]
        self.pp_group = dist.group.WORLD
        # every rank creates the group of the two ends; only they use it (a V has both on 0)
        self.ends = (dist.new_group([0, p.pp - 1]) if self.config.model.tied and p.virtual == 1
                     else None)
        self.tied = model.embed.weight if tied else None
        self.tied_copy = tied and not self.first  # the last stage's copy of it
        self.tied_apart = tied and self.head_copy is None  # the two ends on two ranks

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        """The step's gradients; this rank's mean loss (None on a stage without the loss)."""
        ids, targets = ids.to(device()), targets.to(device())
        if self.stage is None:
            loss = cross_entropy(self.model(ids), targets)
            loss.backward()
            return loss.item()
        losses = []
        inputs = (ids,) if self.first else ()
        self.stage.step(*inputs, **(dict(target=targets, losses=losses) if self.last else {}))
        if self.tied_apart:  # the ends' two halves of one gradient
            dist.all_reduce(self.tied.grad, group=self.ends)
        if self.head_copy is not None:  # both halves on this rank: each copy gets the sum
            self.tied.grad += self.head_copy.grad
            self.head_copy.grad.copy_(self.tied.grad)
        return sum(x.item() for x in losses) / len(losses) if losses else None

    def by_mesh(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """`params` grouped by the mesh their gradients live on (None: plain tensors):
        torch's norm and clip take one kind at a time."""
        from torch.distributed.tensor import DTensor

        groups: dict = {}
        for q in params:
            if q.grad is not None:
                key = q.grad.device_mesh if isinstance(q.grad, DTensor) else None
                groups.setdefault(key, []).append(q)
        return list(groups.values())

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm: torch's norm per mesh, made whole, summed over stages."""
        from torch.distributed.tensor import DTensor

        square = torch.zeros((), dtype=torch.float64, device=device())
        for group in self.by_mesh(self.norm_params):
            norm = torch.nn.utils.get_total_norm([q.grad for q in group])
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            square += norm.to(torch.float64) ** 2
        if self.pp_group is not None:
            dist.all_reduce(square, group=self.pp_group)
        return square.sqrt()

    def step(self, ids: torch.Tensor, targets: torch.Tensor, lr: float) -> tuple[float, float]:
        """One optimizer step: (the batch's mean loss, the global gradient norm)."""
        loss = self.forward_backward(ids, targets)
        norm = self.grad_norm()
        if self.config.optim.grad_clip > 0:
            for group in self.by_mesh(self.params):
                torch.nn.utils.clip_grads_with_norm_(group, self.config.optim.grad_clip,
                                                     norm.to(group[0].dtype))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._batch_loss(loss), norm.item()

    def _batch_loss(self, mine: float | None) -> float:
        """The batch's mean loss on every rank: dp ranks' means averaged, or the last
        stage's sent to all."""
        box = torch.tensor([mine or 0.0], dtype=torch.float64, device=device())
        dist.all_reduce(box)
        if self.stage is not None:
            return box.item()  # only the last stage added its loss
        return box.item() / world_size()  # tp ranks hold the same loss: a mean over all

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters under the twin's names (every rank must call it: FSDP2 and
        DTensor gather). Pipeline stages return their own layers only."""
        from torch.distributed.tensor import DTensor

        mine = {id(q) for q in self.params}
        return {name: (q.full_tensor() if isinstance(q, DTensor) else q).detach().clone()
                for name, q in self.twin.named_parameters() if id(q) in mine}
