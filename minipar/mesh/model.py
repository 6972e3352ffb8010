"""A model cut into layers, run on a mesh: the layers shared out as pipeline stages over
`pp` (each layer already tensor parallel over `tp`, or context parallel over `cp`, as
its builder made it), one step through the schedule, and the one gradient that exists
only because techniques meet.

`MeshModel` is the composition every model on a mesh shares: lesson 07's decoder
(`twin_check.MeshDecoder`) and the trainer's (`minipar train`), both cut into layers by
`decoder.decoder_layers`.
What runs over `dp` is its owner's choice: the owner wraps the local stages
(`data_parallel`, e.g. a `StageDataParallel`: DDP, ZeRO-1/2 or ZeRO-3 over each stage)
before the pipeline sees their parameters, and the pipeline then reduces each stage's
gradients inside its last backward of the step.

The head is tied to the token embedding, and with pp > 1 the first and last stages hold
separate copies of that weight. As Megatron-LM does, their gradients are summed between
the two stages (its "embedding group") so both copies take the same step. In a V
(ZB-V, DualPipeV) both ends live on pipeline rank 0: one weight, as without a pipeline,
whose gradient adds up on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import collectives
from ..pipeline import Pipeline, Stage, schedule, split_model
from ..runtime import rank, world_size
from .mesh import MeshGroups
from .stage_data_parallel import StageDataParallel

NamedLayers = list[tuple[str, nn.Module]]  # (the twin's name prefix, layer)
# this rank's stages (index -> module) and the tied weight -> their data parallelism
WrapStages = Callable[[dict[int, nn.Module], nn.Parameter | None], StageDataParallel | None]


def stage_boundaries(layers: int, stages: int) -> list[int]:
    """Where each stage after the first begins: the blocks shared out evenly, the embedding
    joining the first stage and the head the last (layers counts all three kinds)."""
    blocks = layers - 2
    if not 1 <= stages <= blocks:
        raise ValueError(f"the pipeline's stages (pp x virtual) must be between 1 and the "
                         f"number of blocks ({blocks}); got {stages}")
    # 1 +: layer 0 is the embedding; integer division spreads the blocks within one of even
    return [1 + (blocks * s) // stages for s in range(1, stages)]


def tied_ends_on_one_rank(schedule_name: str) -> ValueError:
    """The one line for a schedule that puts both ends on one rank (a V's rank 0) under
    data parallelism, whose wrappers would each own the one tied weight."""
    return ValueError(f"schedule {schedule_name!r} puts the tied embedding and head on one "
                      "pipeline rank, where data parallelism (dp > 1 or ZeRO) would reduce the "
                      "shared weight once per stage: untie them (model.tied=false) or choose a "
                      "schedule that loops, such as 1f1b")


class MeshModel:
    """This rank's stages of [embedding, blocks..., head] on a mesh with a `pp` dimension
    (of size 1 when there is no pipeline). The first and last layers name the weight they
    share as `tied_weight` (None when untied). `data_parallel(stages, tied)` wraps this
    rank's stages before the pipeline is built (ZeRO makes parameters views of its flat
    buffer) and, when it returns a wrapper, the pipeline reduces through it
    (`Pipeline.reduce_gradients_with`); `make_stage` is the engine's extension point (e.g.
    a stage that computes in another precision)."""

    def __init__(self, named: NamedLayers, groups: MeshGroups, microbatches: int = 1,
                 schedule_name: str = "1f1b", virtual: int = 1,
                 data_parallel: WrapStages | None = None,
                 make_stage: Callable[[nn.Module, int], Stage] | None = None) -> None:
        self.groups = groups
        self.pp_rank, self.pp = rank(groups.pp), world_size(groups.pp)
        plan = schedule(schedule_name, self.pp, microbatches, virtual)
        cuts = [0, *stage_boundaries(len(named), plan.stages), len(named)]
        stages = split_model([m for _, m in named], plan.stages, cuts[1:-1])
        mine = [s for s in range(plan.stages) if plan.rank_of(s) == self.pp_rank]
        self._prefixes = {s: [p for p, _ in named[cuts[s]:cuts[s + 1]]] for s in mine}
        self.local = nn.ModuleList(stages[s] for s in mine)
        self.first_stage, self.last_stage = 0 in mine, plan.stages - 1 in mine
        # both ends here (pp = 1, or a V's rank 0): the tied weight is one Parameter
        self.ends_apart = not (self.first_stage and self.last_stage)
        # the weight the embedding and the head share, on ranks holding either end
        ends = [stages[0][0]] if self.first_stage else []
        ends += [stages[-1][-1]] if self.last_stage else []
        self.tied = ends[0].tied_weight if ends else None
        self.data_parallel = (data_parallel({s: stages[s] for s in mine}, self.tied)
                              if data_parallel is not None else None)
        if self.pp > 1 and not self.ends_apart and self.tied is not None and \
                self.data_parallel is not None and any(self.data_parallel.wrappers.values()):
            # the wrappers would each own the one shared weight: reduced twice, sliced twice
            raise tied_ends_on_one_rank(schedule_name)
        self.pipe = Pipeline(stages, plan, group=groups.pp, make_stage=make_stage)
        self.pipe.reduce_gradients_with(self.data_parallel)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the twin's names (the tied weight once). A layer
        that wraps the twin's module names its parameters itself (`twin_named_parameters`,
        e.g. without its wrapper's prefix); any other layer by its own names."""
        seen = set()
        for s, stage in self.pipe.modules.items():
            for prefix, layer in zip(self._prefixes[s], stage, strict=True):
                named = getattr(layer, "twin_named_parameters", layer.named_parameters)
                for name, p in named():
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield prefix + name, p

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         sync: bool = True) -> float | None:
        """One pipeline step: gradients of the batch's mean `loss_fn` added into .grad (and
        reduced over dp in backward, unless `sync=False`: an accumulation step before the
        optimizer step's last); the loss on ranks holding the last stage, else None. Call
        `sum_tied_gradients` once after the last step of an optimizer step (not per step:
        accumulated gradients would be summed again)."""
        return self.pipe.train_step(ids, targets, loss_fn, sync=sync)

    def evaluate(self, ids: torch.Tensor, targets: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float | None:
        """The batch's mean `loss_fn` with no gradients, on ranks holding the last stage."""
        return self.pipe.evaluate(ids, targets, loss_fn)

    def sum_tied_gradients(self) -> None:
        """The embedding and the head share a weight; with pp > 1 the first and last stage
        each hold a copy, whose gradients add up to the twin's. Call it after the data
        parallelism's reduction and before the step, so both copies then step alike (the
        sum and the average over dp commute: both are linear). Under ZeRO what is summed
        is the reduced slice (`StageDataParallel.tied_holder`)."""
        if not self.ends_apart or self.tied is None:
            return
        holder = self.tied if self.data_parallel is None else self.data_parallel.tied_holder()
        # Megatron-LM's embedding group: the first and the last pipeline rank
        partner = self.pp - 1 if self.pp_rank == 0 else 0
        grad = holder.grad if holder.grad is not None else torch.zeros_like(holder)
        # both ends send and receive in one batch, so neither waits for the other
        theirs = collectives.sendrecv(grad.contiguous(), partner, torch.empty_like(grad),
                                      partner, self.groups.pp, label="tied gradient")
        holder.grad = grad + theirs

    def holds_tied_copy(self, p: nn.Parameter) -> bool:
        """Whether `p` is the last stage's copy of the tied weight (pp > 1): the same entries
        as the first stage's, so a norm counts it there only."""
        return self.ends_apart and self.tied is not None and p is self.tied \
            and not self.first_stage
