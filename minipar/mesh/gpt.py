"""The tiny GPT trained on a mesh: data x pipeline x tensor parallelism composed.

Each technique is the one its own package teaches, given its mesh dimension's group:

- **tp**: every transformer block is a `ParallelTransformerBlock` over `groups.tp`
  (Megatron's column/row split; embeddings, norms and the head replicated);
- **pp**: the layers [embedding, blocks..., head] are cut into `pp` stages and run by
  `Pipeline(..., group=groups.pp)` under a schedule (1F1B by default);
- **dp**: each data-parallel replica takes its rows of the batch (`shard`), and the
  gradients are averaged over `groups.dp` by lesson 02's DDP inside the pipeline's
  backward (or, with `zero=True`, ZeRO-1 shards the optimizer state over `groups.dp`):
  `StageDataParallel`, the one data parallelism the trainer uses too.

The pipeline, the stage cuts and the tied embedding's gradient are `model.MeshModel`'s,
the composition the trainer's decoder shares.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import collectives
from ..data_parallel import shard
from ..models import TinyGPT
from ..runtime import rank, world_size
from ..tensor_parallel import ParallelTransformerBlock
from .mesh import MeshGroups
from .model import MeshModel
from .stage_data_parallel import StageDataParallel


class Embedding(nn.Module):
    """The first layer: token + position embeddings; ids [batch, sequence] in (the batch
    first, so the pipeline cuts micro-batches along it), activations [sequence, batch,
    hidden] out, as the blocks take them."""

    def __init__(self, twin: TinyGPT) -> None:
        super().__init__()
        self.tokens, self.positions = copy.deepcopy(twin.tokens), copy.deepcopy(twin.positions)

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # the pipeline cuts micro-batches along dim 0, the blocks want [sequence, batch]
        ids = ids.t()
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[0]))[:, None, :]


class Head(nn.Module):
    """The last layer: the final norm and the output projection tied to `tokens`."""

    def __init__(self, twin: TinyGPT, tokens: nn.Embedding) -> None:
        super().__init__()
        # `tokens` itself, not a copy: with pp = 1 embedding and head share one Parameter, as the
        # twin does; with pp > 1 the stages' copies are kept equal by
        # MeshModel.sum_tied_gradients
        self.norm, self.tokens = copy.deepcopy(twin.norm), tokens

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) @ self.tokens.weight.t()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [sequence, batch, vocab] against targets [batch, sequence]."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       targets.t().reshape(-1))


def gpt_layers(twin: TinyGPT, tp_group=None) -> list[tuple[str, nn.Module]]:
    """The GPT as a sequence of (twin name prefix, layer): embedding, blocks (tensor
    parallel over `tp_group`), head. The prefixes name each parameter as the twin does."""
    embedding = Embedding(twin)
    blocks = [(f"blocks.{i}.", ParallelTransformerBlock(b, tp_group))
              for i, b in enumerate(twin.blocks)]
    return [("", embedding), *blocks, ("", Head(twin, embedding.tokens))]


class MeshGPT:
    """This rank's part of a TinyGPT trained on a mesh with dimensions dp, pp and tp (any of
    them may be 1). `train_step` runs one batch and the optimizer; `named_parameters`
    names this rank's parameters as the twin does, so each can be checked against it."""

    def __init__(self, twin: TinyGPT, groups: MeshGroups, optimizer: Callable,
                 microbatches: int = 2, schedule_name: str = "1f1b", zero: bool = False) -> None:
        self.groups, self.zero = groups, zero

        def data_parallel(stages: dict[int, nn.Module], tied: nn.Parameter | None
                          ) -> StageDataParallel:
            # ZeRO makes the parameters views of its flat buffer: before the pipeline sees them
            return StageDataParallel(stages, int(zero), optimizer, groups.dp, tied)

        self.model = MeshModel(gpt_layers(twin, groups.tp), groups, microbatches,
                               schedule_name, data_parallel=data_parallel)
        self.data_parallel = self.model.data_parallel
        self.optimizer = (self.data_parallel.optimizer if zero
                          else optimizer(list(self.model.local.parameters())))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the twin's names (the tied weight once)."""
        return self.model.named_parameters()

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Gradients of the whole batch's mean loss on this rank's parameters, averaged over
        dp (DDP during backward; ZeRO-1 reduce-scatters after it into its slices); returns
        the loss on last-stage ranks."""
        dp = self.groups.dp
        local_ids = shard(ids, rank(dp), world_size(dp))
        local_targets = shard(targets, rank(dp), world_size(dp))
        loss = self.model.forward_backward(local_ids, local_targets, gpt_loss)
        self.data_parallel.reduce_gradients()
        self.model.sum_tied_gradients()  # after the reduction: the sum is of averages
        if loss is None:
            return None
        # each dp replica's loss is the mean over its own rows: their mean is the batch's
        return collectives.all_reduce(torch.tensor([loss], dtype=torch.float64), op="avg",
                                      group=dp).item()

    def step(self) -> None:
        """The optimizer step (ZeRO-1: update this rank's slice, gather)."""
        if self.zero:
            self.data_parallel.update()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        loss = self.forward_backward(ids, targets)
        self.step()
        return loss


def twin_slice(full: torch.Tensor, local: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The part of a twin's tensor that a tensor-parallel rank holds: whole if the shapes
    agree, else the tp_rank-th chunk along the dimension that was split."""
    if full.shape == local.shape:
        return full
    # column-parallel weights are split along dim 0 (output features), row-parallel ones along
    # the last (input features)
    dim = 0 if full.shape[0] != local.shape[0] else full.dim() - 1
    return full.chunk(tp, dim)[tp_rank]


def check_against_twin(mesh_dims: dict[str, int], zero: bool = False, steps: int = 2,
                       microbatches: int = 2, seed: int = 3) -> dict:
    """Run on every rank of a launched mesh: train a float64 TinyGPT for `steps` Adam steps
    on the mesh and on one process (the twin, on this rank) from the same weights and
    data; return the losses this rank saw (last pipeline stage only), the largest gap to
    the twin's, the names of gradients (first step) and of
    parameters (after the last step) that differ, and this rank's coordinates."""
    from .mesh import Mesh

    groups = Mesh(**mesh_dims).connect()
    kwargs = dict(vocab=32, hidden=16, heads=4, layers=4, seq_len=8, seed=seed,
                  dtype=torch.float64)
    # two builds from one seed: identical weights, one for the twin and one to cut up
    twin = TinyGPT(**kwargs)
    model = MeshGPT(TinyGPT(**kwargs), groups, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                    microbatches=microbatches, zero=zero)
    reference = torch.optim.Adam(twin.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + 1)
    tp_rank, tp = rank(groups.tp), world_size(groups.tp)
    twin_params = dict(twin.named_parameters())
    gap, wrong_grads, wrong_params, losses = 0.0, [], [], []
    for step in range(steps):
        ids = torch.randint(0, 32, (8, 8), generator=gen)
        targets = torch.randint(0, 32, (8, 8), generator=gen)
        loss = model.forward_backward(ids, targets)
        ref_loss = gpt_loss(twin(ids.t()), targets)
        ref_loss.backward()
        if loss is not None:
            gap = max(gap, abs(loss - ref_loss.item()))
            losses.append(loss)
        if step == 0 and not zero:  # ZeRO-1 has averaged nothing yet: compare after steps
            wrong_grads = [n for n, p in model.named_parameters() if not torch.allclose(
                p.grad, twin_slice(twin_params[n].grad, p, tp_rank, tp), rtol=1e-9,
                atol=1e-12)]
        model.step()
        reference.step()
        reference.zero_grad(set_to_none=True)
    # Adam divides each gradient by its own running size, so an entry whose gradient is
    # tiny turns rounding (summation order differs across ranks) into ~1e-12 of the lr-sized
    # step; a real mistake moves parameters by ~lr = 1e-2
    wrong_params = [n for n, p in model.named_parameters() if not torch.allclose(
        p.detach(), twin_slice(twin_params[n].detach(), p, tp_rank, tp), rtol=1e-9,
        atol=1e-10)]
    return {"coords": groups.coords, "losses": losses, "loss_gap": gap,
            "wrong_grads": wrong_grads, "wrong_params": wrong_params}
