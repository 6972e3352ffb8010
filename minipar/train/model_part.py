"""The trainer's model on this rank: `ModelPart`, the decoder cut over the run's mesh,
dp x pp x cp x tp (and ep inside dp for a mixture of experts), with its optimizer. It is
what the loop drives for every layout, data parallelism alone being the mesh with
pp = tp = cp = 1: a step's forward and backward on this rank's rows, the gradients
reduced, the ones this rank owns, the global norm's share, AdamW's update.

The mesh is `Mesh(pp, replicate, dp, ep, cp, tp)`: tp fastest, then cp, ep, dp, HSDP's
replicate groups, pp outermost, the order Megatron-LM numbers its ranks in, so a
tensor-parallel group is neighbouring ranks. The model is `mesh.MeshModel` over
`mesh.decoder_layers`, the composition lesson 07's `MeshDecoder` shares; every step
goes through the pipeline engine (one stage when pp = 1), each stage computing in the
run's precision (`AutocastStage`, or `fp8.Fp8Stage`: the engine's extension point).

Data parallelism runs inside the pipeline's backward (`mesh.StageDataParallel`: lesson
02's DDP or lesson 06's ZeRO-1/2/3 over each stage, reduced in the stage's last backward
of the optimizer step). Its group is every rank holding the same weights:

- dp x cp for the dense weights (each cp rank's loss is the mean over its own tokens, so
  the average over cp is the mean over the sequence, as Megatron-LM's dp-cp group);
- x ep as well: an ep rank's tokens are other rows of the batch (ep lives inside dp);
- a mixture's experts live on one ep rank each: averaged over dp only, their gradients
  first divided by ep (each rank's loss is a mean over its own rows; moe/moe_decoder.py).

Under sequence parallelism the blocks' norm gradients are summed over tp inside backward
too, before any data-parallel hook sees them. After backward only the tied embedding's
two copies are summed across the pipeline's ends, once per optimizer step.

The global norm counts each entry once: a tp-split matrix's slice on every tp rank, a
tp-replicated tensor on tp rank 0 only, the tied weight on the first stage only, stages
summed over pp, and either the replicas counted once (ep rank 0's dense weights) or,
under ZeRO, every rank's distinct slices.

Weight decay is AdamW's, decoupled, applied by hand before an Adam step with none
(`p *= 1 - lr * wd`, exactly what torch's AdamW does first): a ZeRO slice mixes matrices
and norm gains in one flat vector, so which entries decay is a mask, and the one-process
run takes the same arithmetic path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import collectives
from ..data_parallel import shard_weight
from ..decoder import Decoder
from ..mesh import Mesh
from ..mesh.decoder_layers import (
    decoder_layers,
    decoder_loss,
    held_positions,
    sum_block_norms_in_backward,
)
from ..mesh.model import MeshModel
from ..mesh.stage_data_parallel import StageDataParallel
from ..moe.expert_parallel import average_experts_over_ep
from ..moe.moe_decoder import ExpertParallelBlock, balance_experts, cut_expert_parallel
from ..runtime import device, rank, world_size
from ..sharded import FlatShard
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from .compile_blocks import compile_blocks
from .config import ParallelConfig, TrainConfig
from .optim import set_learning_rate
from .precision import LossScaler, make_stage
from .recompute import apply_recompute

# layers whose weight alone is split over tp: each rank counts its slice in the norm
SPLIT_WEIGHT = (RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def decays(name: str, p: nn.Parameter) -> bool:
    """Whether AdamW's weight decay applies: matrices do; norm gains and the embedding
    (tied to the head or not) are spared, as in GPT-NeoX and Llama's recipes."""
    return p.dim() >= 2 and "embed" not in name


def shard_mask(shard: FlatShard, chosen: set[int]) -> torch.Tensor:
    """1 where this rank's slice of `shard` holds an entry of a parameter in `chosen` (ids),
    else 0: which entries of a ZeRO slice decay, or count towards the norm."""
    flat = shard.flatten([torch.full(p.shape, float(id(p) in chosen), device=p.device)
                          for p in shard.params])
    return flat[shard.rank * shard.slice:(shard.rank + 1) * shard.slice].to(shard.master.dtype)


def adam_factory(config: TrainConfig) -> Callable[[list], torch.optim.Adam]:
    """Adam without decay (applied by hand, see the module docstring); foreach=False: one
    tensor at a time, the same arithmetic whatever the layout."""
    o = config.optim
    return lambda params: torch.optim.Adam(params, lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, foreach=False)


def trainer_mesh(config: TrainConfig) -> Mesh:
    """The run's mesh, in Megatron-LM's order (pp outermost, tp fastest; ep inside dp). dp
    is split in two, as torchtitan's dp_replicate x dp_shard: `replicate` (HSDP's groups,
    1 otherwise) outside `dp` (the ranks ZeRO shards over)."""
    p = config.parallel
    return Mesh(pp=p.pp, replicate=p.dp_replicate, dp=p.dp // (p.ep * p.dp_replicate),
                ep=p.ep, cp=p.cp, tp=p.tp)


def replica_dimensions(p: ParallelConfig) -> tuple[str, ...]:
    """The mesh dimensions over which ranks hold the same dense weights and see other
    tokens (dp, ep, cp), those above 1; their joined group is data parallelism's."""
    dp = p.dp // (p.ep * p.dp_replicate)  # under HSDP: one group's ranks
    return tuple(d for d, n in (("dp", dp), ("ep", p.ep), ("cp", p.cp)) if n > 1)


class ModelPart:
    """This rank's part of the decoder on the run's mesh, and the optimizer over it."""

    def __init__(self, twin: Decoder, config: TrainConfig) -> None:
        self.weight_decay, self.precision = config.optim.weight_decay, config.train.precision
        self.stepped = False  # whether a train_step ran: its collectives were checked (loop.py)
        par = config.parallel
        joined = replica_dimensions(par)
        mesh = trainer_mesh(config)
        self.groups = mesh.connect()  # one group per dimension
        g = self.groups
        # data parallelism's group: the ranks holding the same dense weights (under HSDP,
        # those of one replica group: ZeRO shards over it). Made fresh: DDP's buckets go
        # over it on their own thread, and gloo mixes up two threads' messages on one group
        # (with dp = 1 and cp = 2 it was cp's, whose ring attention runs in the same backward)
        self.replicas = mesh.fresh_group(*joined) if joined else g.dp
        # the data-parallel replicas are replicate x dp x ep ranks: all take different rows
        self.dp_rank = (rank(g.replicate) * world_size(g.dp) + rank(g.dp)) * par.ep + rank(g.ep)
        self.dp = par.dp
        self.ep, self.zero = par.ep, par.zero
        self.tp_rank = rank(g.tp)
        self.positions = held_positions(g, config.model.seq_len)
        self.loss = decoder_loss(g, config.model.vocab_size)  # vocab-parallel over tp
        adam = adam_factory(config)
        cut = cut_expert_parallel if config.model.experts else None
        layers = decoder_layers(twin, g, par.sequence_parallel, cut, par.cp_kind)
        # experts live on one ep rank each: replicated over dp only (module docstring)
        self.experts = {id(p) for _, layer in layers for m in layer.modules()
                        if isinstance(m, ExpertParallelBlock) for p in m.experts()}
        if self.ep > 1:
            average_experts_over_ep((p for _, layer in layers for p in layer.parameters()
                                     if id(p) in self.experts), self.ep)
        self.balanced = self._balance(config, nn.ModuleList(layer for _, layer in layers))
        self.loads: list[list[float]] | None = None  # each block's expert loads, last step

        def data_parallel(stages: dict[int, nn.Module], tied: nn.Parameter | None
                          ) -> StageDataParallel:
            # before the pipeline: ZeRO makes the parameters views of its flat buffers
            experts = {i: g.dp for i in self.experts} if self.ep > 1 else None
            return StageDataParallel(stages, par.zero, adam, self.replicas, tied, experts,
                                     replicate=g.replicate)

        self.model = MeshModel(layers, g, par.microbatches, par.schedule, par.virtual,
                               data_parallel=data_parallel,
                               make_stage=make_stage(config.train.precision))
        if par.sequence_parallel:
            sum_block_norms_in_backward(self.model.local, g.tp)
        apply_recompute(self.model.local, config.train.recompute)
        if config.train.compile:  # after recomputation, as torchtitan orders them
            compile_blocks(self.model.local)
        self.sharded = self.model.data_parallel if par.zero else None
        named = list(self.model.named_parameters())
        self.optimizer = (self.sharded.optimizer if self.sharded is not None
                          else adam([p for _, p in named]))
        self.masks = self.decay_masks(named)
        self.norm_masks = self._norm_masks(named)
        # which masks are all ones (no copy needed), read at the first norm: a dry run builds
        # on the meta device, whose tensors hold no values to read (dry_run.py)
        self._counted_whole: list[bool] | None = None

    def _balance(self, config: TrainConfig, layers: nn.Module) -> list:
        """With experts, each block's feed-forward counts its load and balances as
        model.balance says (moe/balance.py); the auxiliary loss all-reduces its counts over
        a group of its own, the ranks that hold other tokens (replicate x dp x ep)."""
        m = config.model
        if not m.experts:
            return []
        mesh = trainer_mesh(config)
        tokens = [d for d in ("replicate", "dp", "ep") if mesh[d] > 1]
        group = mesh.fresh_group(*tokens) if m.balance == "aux" and tokens else None
        return balance_experts(layers, m.balance, m.balance_coef, m.bias_rate, group, device())

    def end_balance_step(self) -> None:
        """After the optimizer step: every block's expert loads over the step's global batch
        (one all-reduce over the run, each rank adding its tokens' counts for the blocks it
        holds), kept in `loads` for the log and, for "bias", stepped by: every rank steps
        every block's bias, so rank 0 can checkpoint them all."""
        if not self.balanced:
            return
        held = {id(m) for m in self.model.local.modules()}
        loads = torch.stack([ff.balance.load if id(ff) in held else torch.zeros_like(
            ff.balance.load) for ff in self.balanced])
        loads = collectives.all_reduce(loads)
        for ff, load in zip(self.balanced, loads, strict=True):
            ff.balance.end_step(load)
        self.loads = loads.tolist()

    def decay_masks(self, named: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        """Per optimizer tensor, 1 where AdamW decays: by parameter, or by entry of a slice."""
        decayed = {id(p) for name, p in named if decays(name, p)}
        if self.sharded is not None:
            return [shard_mask(s, decayed) for s in self.sharded.shards]
        # in the parameter's dtype: a float32 mask would round 1 - lr * wd in float32
        return [torch.tensor(float(id(p) in decayed), dtype=p.dtype, device=p.device)
                for _, p in named]

    def owned_gradients(self) -> list[torch.Tensor | None]:
        """The gradients this rank's optimizer steps with: whole parameters' or ZeRO slices'."""
        return [p.grad for group in self.optimizer.param_groups for p in group["params"]]

    def update(self, lr: float) -> None:
        """Decoupled weight decay, the Adam step at rate `lr`, gradients dropped."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, mask in zip(params, self.masks, strict=True):
                p.mul_(1 - lr * self.weight_decay * mask)  # AdamW's first line, masked
        set_learning_rate(self.optimizer, lr)
        if self.sharded is not None:
            self.sharded.update()  # the step, then (ZeRO-1/2) the parameters gathered
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def skip(self) -> None:
        """Drop this step's gradients without updating (an fp16 overflow)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.parameters():
            p.grad = None

    def _norm_masks(self, named: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        """Per optimizer tensor, 1 where this rank counts the entry in the global norm."""
        # a column-parallel layer splits its weight and bias by rows; a row-parallel one its
        # weight only (its bias is added once, after the sum), and the vocab-parallel
        # embedding and head their rows: the decoder has no biases
        split = {id(p) for m in self.model.local.modules()
                 for p in ([m.weight, m.bias] if isinstance(m, ColumnParallelLinear) else
                           [m.weight] if isinstance(m, SPLIT_WEIGHT) else [])
                 if p is not None}
        ep_rank = rank(self.groups.ep)
        counted = {id(p) for _, p in named
                   if (id(p) in split or self.tp_rank == 0)  # replicated over tp: once
                   # replicated over ep: once, unless ZeRO gave each replica its own slice
                   and (id(p) in self.experts or ep_rank == 0 or self.sharded is not None)
                   and not self.model.holds_tied_copy(p)}  # the tied weight: once
        if self.sharded is not None:
            return [shard_mask(s, counted) for s in self.sharded.shards]
        return [torch.tensor(float(id(p) in counted), dtype=p.dtype, device=p.device)
                for _, p in named]

    @property
    def module(self) -> nn.Module:
        """The module whose parameters this rank holds: its stages, cut for its tp and cp."""
        return self.model.local

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.local.parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters()

    def _loss_fn(self, weight: float):
        return lambda logits, targets: self.loss(logits, targets) * weight

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor, batch: int,
                         scaler: LossScaler, last: bool) -> float | None:
        """One pipeline step on this rank's rows and tokens, its loss weighted by the chunk's
        share of the `batch` rows; the weighted loss on last-stage ranks, else None.
        `last`: the optimizer step's last chunk, whose backward reduces over dp."""
        weight = shard_weight(len(ids), batch, self.dp) * scaler.scale
        for ff in self.balanced:  # the loss's weight per token: the auxiliary loss's too
            ff.balance.token_weight = weight / (len(ids) * len(self.positions))
        loss = self.model.forward_backward(ids[:, self.positions], targets[:, self.positions],
                                           self._loss_fn(weight), sync=last)
        return None if loss is None else loss / scaler.scale

    def eval_loss(self, ids: torch.Tensor, targets: torch.Tensor, batch: int) -> float | None:
        """This rank's weighted share of the batch's mean loss (last stage), no gradients."""
        weight = shard_weight(len(ids), batch, self.dp)
        return self.model.evaluate(ids[:, self.positions], targets[:, self.positions],
                                   self._loss_fn(weight))

    def agree(self, loss_share: float | None, squares: torch.Tensor, overflow: bool
              ) -> tuple[float, float, bool]:
        """The step's three scalars, in one all-reduce over the run instead of one per
        scalar and group (each a few milliseconds of messages): the batch's mean loss (as
        `mean_over_ranks`), the gradients' squares counted once per entry (as
        `optim.global_norm` over `norm_groups`) and whether any rank overflowed. Every term
        is a sum over all ranks, each rank's divided by the copies of it the run holds:
        the loss's dp x cp x tp, the squares' world / (the norm groups' sizes)."""
        g = self.groups
        loss_copies = self.dp * world_size(g.cp) * world_size(g.tp)
        distinct = math.prod(world_size(group) for group in self.norm_groups())
        loss = 0.0 if loss_share is None else loss_share / loss_copies
        terms = torch.tensor([loss, 0.0, float(overflow)], dtype=torch.float64,
                             device=device())
        terms[1] = squares / (world_size() // distinct)
        loss, total, overflows = collectives.all_reduce(terms).tolist()
        return loss, total, overflows > 0

    def mean_over_ranks(self, share: float | None) -> float:
        """The batch's mean: the last stage's shares summed over the run, each tp rank's
        copy and each cp rank's mean over its tokens counted 1/(tp cp), each of the dp
        replicas (ep ranks included) 1/dp."""
        g = self.groups
        copies = self.dp * world_size(g.cp) * world_size(g.tp)
        total = torch.tensor([0.0 if share is None else share / copies], dtype=torch.float64,
                             device=device())
        return collectives.all_reduce(total).item()

    def reduce_gradients(self) -> None:
        """What backward left: ZeRO-1's reduce-scatter (the rest ran inside backward), then
        the tied weight's two reduced copies summed across the pipeline's ends."""
        self.model.data_parallel.reduce_gradients()
        self.model.sum_tied_gradients()

    def norm_gradients(self) -> list[torch.Tensor | None]:
        """The owned gradients, each entry this rank does not count zeroed (a copy; a
        gradient this rank counts whole is passed as it is)."""
        if self._counted_whole is None:
            self._counted_whole = [bool(m.all()) for m in self.norm_masks]
        return [g if g is None or whole else g * m for g, m, whole
                in zip(self.owned_gradients(), self.norm_masks, self._counted_whole, strict=True)]

    def norm_groups(self) -> list:
        """Where ranks hold distinct entries: tp, pp, and ep (experts) or, under ZeRO, every
        replica (its own slices)."""
        g = self.groups
        groups = [g.tp, g.pp, self.replicas if self.sharded is not None else g.ep]
        return [group for group in groups if world_size(group) > 1]  # a sum over 1: nothing

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters under the twin's names: tp ranks hold slices (see
        `mesh.twin_slice`), pp ranks their stages' layers (ZeRO-3 gathers them: a
        collective over the replicas)."""
        if self.zero == 3:
            self.model.data_parallel.gather_parameters()
        yield from ((n, p.detach()) for n, p in self.model.named_parameters())
