"""The trainer's decoder cut over a mesh, dp x pp x cp x tp (and ep inside dp for a
mixture of experts): `MeshReplica`, the `Replica` the loop drives when any of pp, tp, cp,
ep is above 1.

The mesh is `Mesh(pp, dp, ep, cp, tp)`: tp fastest, then cp, ep, dp, pp outermost, the order
Megatron-LM numbers its ranks in, so a tensor-parallel group is neighbouring ranks. The
model is `mesh.MeshModel` over `mesh.decoder_layers`, the composition lesson 07's GPT
shares; every step goes through the pipeline engine (one stage when pp = 1), each stage
computing in the run's precision (`AutocastStage`, the engine's extension point).

After the schedule's backward, gradients meet in this order:
1. the tied embedding's two copies summed across the pipeline's ends (MeshModel), once
   per optimizer step, after the last accumulation chunk;
2. under sequence parallelism, the blocks' norm gradients summed over tp;
3. every gradient averaged over cp (each cp rank's loss is the mean over its tokens);
4. with experts over ep (inside dp): the dense weights averaged over ep, the experts'
   gradients divided by ep (moe/decoder.py says why);
5. averaged over dp (zero = 0), or reduce-scattered over dp into ZeRO-1/2 slices. The
   engine computes gradients with autograd.grad, which fires no accumulation hooks, so
   ZeRO-2 reduce-scatters after backward, as ZeRO-1 does.

The global norm counts each entry once: a tp-split matrix's slice on every tp rank, a
tp-replicated tensor on tp rank 0 only, the tied weight on the first stage only, stages
summed over pp, ZeRO slices over dp.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .. import collectives
from ..data_parallel import average_gradients, shard_weight
from ..decoder import Decoder
from ..mesh import Mesh
from ..mesh.decoder import decoder_layers, held_positions, sync_block_norms
from ..mesh.model import MeshModel
from ..moe.decoder import ExpertParallelBlock, cut_expert_parallel
from ..runtime import rank, world_size
from ..sharded import ZeroDataParallel
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .config import TrainConfig
from .precision import AutocastStage, LossScaler
from .recompute import apply_recompute
from .replicas import Replica, adam_factory, cross_entropy, shard_mask


def trainer_mesh(config: TrainConfig) -> Mesh:
    """The run's mesh, in Megatron-LM's order (pp outermost, tp fastest; ep inside dp)."""
    p = config.parallel
    return Mesh(pp=p.pp, dp=p.dp // p.ep, ep=p.ep, cp=p.cp, tp=p.tp)


class MeshReplica(Replica):
    """This rank's part of the decoder on the run's mesh, trained by the loop."""

    def __init__(self, twin: Decoder, config: TrainConfig) -> None:
        super().__init__(config)
        par = config.parallel
        self.groups = trainer_mesh(config).connect()
        g = self.groups
        # the data-parallel replicas are dp x ep ranks: ep ranks hold different rows too
        self.dp_rank, self.dp = rank(g.dp) * par.ep + rank(g.ep), par.dp
        self.ep = par.ep
        self.tp_rank = rank(g.tp)
        self.sequence_parallel = par.sequence_parallel
        self.positions = held_positions(g, config.model.seq_len)
        adam = adam_factory(config)

        def shard(local: nn.ModuleList) -> ZeroDataParallel | None:
            # before the pipeline: ZeRO makes the parameters views of its flat buffer
            return ZeroDataParallel(local, adam, stage=par.zero, group=g.dp) if par.zero \
                else None

        precision = config.train.precision
        cut = cut_expert_parallel if config.model.experts else None
        self.model = MeshModel(decoder_layers(twin, g, par.sequence_parallel, cut), g,
                               par.microbatches, par.schedule, par.virtual, shard=shard,
                               make_stage=lambda module, i: AutocastStage(module, i, precision))
        apply_recompute(self.model.local, config.train.recompute)
        # experts live on one ep rank each: averaged over dp only (module docstring, step 4)
        self.experts = {id(p) for m in self.model.local.modules()
                        if isinstance(m, ExpertParallelBlock) for p in m.experts()}
        self.sharded = self.model.sharded
        named = list(self.model.named_parameters())
        self.optimizer = self.sharded.optimizer if self.sharded else adam([p for _, p in named])
        self.masks = self.decay_masks(named)
        self.norm_masks = self._norm_masks(named)

    def _norm_masks(self, named: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        """Per optimizer tensor, 1 where this rank counts the entry in the global norm."""
        # a column-parallel layer splits its weight and bias by rows; a row-parallel one its
        # weight only (its bias is added once, after the sum): the decoder has no biases
        split = {id(p) for m in self.model.local.modules()
                 for p in ([m.weight, m.bias] if isinstance(m, ColumnParallelLinear) else
                           [m.weight] if isinstance(m, RowParallelLinear) else [])
                 if p is not None}
        ep_rank = rank(self.groups.ep)
        counted = {id(p) for _, p in named
                   if (id(p) in split or self.tp_rank == 0)  # replicated over tp: once
                   and (id(p) in self.experts or ep_rank == 0)  # replicated over ep: once
                   and not self.model.holds_tied_copy(p)}  # the tied weight: once
        if self.sharded is not None:
            return [shard_mask(s, counted) for s in self.sharded.shards]
        return [torch.tensor(float(id(p) in counted), dtype=p.dtype) for _, p in named]

    @property
    def module(self) -> nn.Module:
        """The module whose parameters this rank holds: its stages, cut for its tp and cp."""
        return self.model.local

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.local.parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters()

    def _loss_fn(self, weight: float):
        return lambda logits, targets: cross_entropy(logits, targets) * weight

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor, batch: int,
                         scaler: LossScaler, last: bool) -> float | None:
        """One pipeline step on this rank's rows and tokens, its loss weighted by the chunk's
        share of the `batch` rows; the weighted loss on last-stage ranks, else None.
        (`last` is DDP's cue to all-reduce; here gradients meet in reduce_gradients.)"""
        weight = shard_weight(len(ids), batch, self.dp) * scaler.scale
        loss = self.model.forward_backward(ids[:, self.positions], targets[:, self.positions],
                                           self._loss_fn(weight))
        return None if loss is None else loss / scaler.scale

    def eval_loss(self, ids: torch.Tensor, targets: torch.Tensor, batch: int) -> float | None:
        """This rank's weighted share of the batch's mean loss (last stage), no gradients."""
        weight = shard_weight(len(ids), batch, self.dp)
        return self.model.evaluate(ids[:, self.positions], targets[:, self.positions],
                                   self._loss_fn(weight))

    def mean_over_ranks(self, share: float | None) -> float:
        """The batch's mean: the last stage's shares summed over the run, each tp rank's
        copy and each cp rank's mean over its tokens counted 1/(tp cp), each of the dp
        replicas (ep ranks included) 1/dp."""
        g = self.groups
        copies = self.dp * world_size(g.cp) * world_size(g.tp)
        total = torch.tensor([0.0 if share is None else share / copies], dtype=torch.float64)
        return collectives.all_reduce(total).item()

    def reduce_gradients(self) -> None:
        """Steps 1-5 of the module docstring, once per optimizer step."""
        g, local = self.groups, self.parameters()
        self.model.sum_tied_gradients()
        if self.sequence_parallel:
            sync_block_norms(self.model.local, g.tp)
        average_gradients(local, g.cp)
        if self.ep > 1:
            average_gradients([p for p in local if id(p) not in self.experts], g.ep)
            for p in local:
                if id(p) in self.experts and p.grad is not None:
                    # its gradient summed what every ep rank's tokens asked of it, each
                    # rank's loss a mean over its own rows: /ep makes it their mean
                    p.grad /= self.ep
        if self.sharded is not None:
            self.sharded.reduce_gradients()
        else:
            average_gradients(local, g.dp)

    def norm_gradients(self) -> list[torch.Tensor | None]:
        """The owned gradients, each entry this rank does not count zeroed (a copy)."""
        return [None if g is None else g * m
                for g, m in zip(self.owned_gradients(), self.norm_masks, strict=True)]

    def norm_groups(self) -> list:
        """Where ranks hold distinct entries: tp, pp, ep (experts), and dp under ZeRO."""
        g = self.groups
        return [g.tp, g.pp, g.ep] + ([g.dp] if self.sharded is not None else [])

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters under the twin's names: tp ranks hold slices (see
        `mesh.twin_slice`), pp ranks their stages' layers."""
        yield from ((n, p.detach()) for n, p in self.model.named_parameters())
