"""The trainer's model on its ranks, behind one small interface the loop drives
(`Replica`): a step's forward and backward on this rank's rows, the gradients reduced,
the ones this rank owns, AdamW's update. `MeshReplica` (composed.py) implements it for
every layout: the decoder cut over a mesh, dp x pp x cp x tp (and ep inside dp for a
mixture of experts), data parallelism alone being the mesh with pp = tp = cp = 1.

Weight decay is AdamW's, decoupled, applied by hand before an Adam step with none
(`p *= 1 - lr * wd`, exactly what torch's AdamW does first): a ZeRO slice mixes matrices
and norm gains in one flat vector, so which entries decay is a mask, and the one-process
run takes the same arithmetic path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..mesh.stage_data_parallel import StageDataParallel
from ..sharded import FlatShard
from .config import TrainConfig
from .optim import set_learning_rate
from .precision import LossScaler


def decays(name: str, p: nn.Parameter) -> bool:
    """Whether AdamW's weight decay applies: matrices do; norm gains and the embedding
    (tied to the head or not) are spared, as in GPT-NeoX and Llama's recipes."""
    return p.dim() >= 2 and "embed" not in name


def shard_mask(shard: FlatShard, chosen: set[int]) -> torch.Tensor:
    """1 where this rank's slice of `shard` holds an entry of a parameter in `chosen` (ids),
    else 0: which entries of a ZeRO slice decay, or count towards the norm."""
    flat = shard.flatten([torch.full(p.shape, float(id(p) in chosen)) for p in shard.params])
    return flat[shard.rank * shard.slice:(shard.rank + 1) * shard.slice].to(shard.master.dtype)


def adam_factory(config: TrainConfig) -> Callable[[list], torch.optim.Adam]:
    """Adam without decay (applied by hand, see the module docstring); foreach=False: one
    tensor at a time, the same arithmetic whatever the layout."""
    o = config.optim
    return lambda params: torch.optim.Adam(params, lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, foreach=False)


class Replica:
    """What every layout shares: AdamW's masked decay and step over the parameters (or
    ZeRO slices) its optimizer holds. A layout sets optimizer, masks and sharded (the
    ZeRO wrappers or None), and writes the methods that differ."""

    optimizer: torch.optim.Optimizer
    masks: list[torch.Tensor]  # per optimizer tensor: 1 where weight decay applies
    sharded: StageDataParallel | None  # ZeRO's wrappers over the stages, or None
    dp_rank: int  # this rank's index among the data-parallel replicas, and their number
    dp: int
    tp_rank: int = 0  # this rank's index in its tensor-parallel group

    def __init__(self, config: TrainConfig) -> None:
        self.weight_decay, self.precision = config.optim.weight_decay, config.train.precision

    def decay_masks(self, named: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
        """Per optimizer tensor, 1 where AdamW decays: by parameter, or by entry of a slice."""
        decayed = {id(p) for name, p in named if decays(name, p)}
        if self.sharded is not None:
            return [shard_mask(s, decayed) for s in self.sharded.shards]
        # in the parameter's dtype: a float32 mask would round 1 - lr * wd in float32
        return [torch.tensor(float(id(p) in decayed), dtype=p.dtype) for _, p in named]

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

    # what each layout writes (the loop calls exactly these)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank holds."""
        raise NotImplementedError

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the twin's names (a tied weight once)."""
        raise NotImplementedError

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor, batch: int,
                         scaler: LossScaler, last: bool) -> float | None:
        """Backward of one accumulation chunk's loss, weighted by its share of the `batch`
        rows; this rank's weighted loss (None where this rank computes no loss)."""
        raise NotImplementedError

    def eval_loss(self, ids: torch.Tensor, targets: torch.Tensor, batch: int) -> float | None:
        """This rank's weighted share of a batch's mean loss, no gradients."""
        raise NotImplementedError

    def mean_over_ranks(self, share: float | None) -> float:
        """The batch's mean loss from every rank's share."""
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        """Every gradient this rank's optimizer steps with, reduced as one process's."""
        raise NotImplementedError

    def norm_gradients(self) -> list[torch.Tensor | None]:
        """The gradient entries this rank counts in the global norm."""
        raise NotImplementedError

    def norm_groups(self) -> list:
        """The process groups over which ranks count distinct entries."""
        raise NotImplementedError

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters under the twin's names, after training."""
        raise NotImplementedError
