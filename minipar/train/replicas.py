"""The trainer's model over data-parallel ranks: the Decoder twin wrapped by the technique
its config names, behind one small interface the loop drives.

- zero = 0: `DataParallel` (lesson 02's DDP: buckets all-reduced during backward,
  `no_sync` while accumulating); every rank holds every gradient, averaged.
- zero = 1, 2: `ZeroDataParallel` (lesson 06); zero = 3: `FullyShardedDataParallel`, each
  block a unit. Each rank's optimizer sees only its slices of the parameters.

Weight decay is AdamW's, decoupled, applied by hand before an Adam step with none
(`p *= 1 - lr * wd`, exactly what torch's AdamW does first): a ZeRO slice mixes matrices
and norm gains in one flat vector, so which entries decay is a mask, and the one-process
run takes the same arithmetic path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from ..data_parallel import DataParallel
from ..decoder import Decoder
from ..runtime import world_size
from ..sharded import FlatShard, FullyShardedDataParallel, ZeroDataParallel
from .config import TrainConfig
from .optim import set_learning_rate
from .precision import autocast


def decays(name: str, p: nn.Parameter) -> bool:
    """Whether AdamW's weight decay applies: matrices do; norm gains and the embedding
    (tied to the head or not) are spared, as in GPT-NeoX and Llama's recipes."""
    return p.dim() >= 2 and "embed" not in name


def _shard_mask(shard: FlatShard, decayed: set[int]) -> torch.Tensor:
    """1 where this rank's slice of `shard` holds a decayed parameter's entry, else 0."""
    flat = shard.flatten([torch.full(p.shape, float(id(p) in decayed)) for p in shard.params])
    return flat[shard.rank * shard.slice:(shard.rank + 1) * shard.slice].to(shard.master.dtype)


class ReplicatedModel:
    """The Decoder on every rank of the run, data parallel in the config's flavour (the
    lesson 02 and 06 wrappers all-reduce over the whole world)."""

    def __init__(self, model: Decoder, config: TrainConfig) -> None:
        optim, zero = config.optim, config.parallel.zero
        self.model, self.zero = model, zero
        named = list(model.named_parameters())  # a tied weight once
        decayed = {id(p) for name, p in named if decays(name, p)}
        # Adam without decay (applied by hand, see the module docstring); foreach=False: one
        # tensor at a time, the same arithmetic whatever the layout
        adam = lambda params: torch.optim.Adam(  # noqa: E731
            params, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
            foreach=False)
        if zero == 0:
            self.wrapper = DataParallel(model)
            self.optimizer = adam([p for _, p in named])
            # in the parameter's dtype: a float32 mask would round 1 - lr * wd in float32
            self.masks = [torch.tensor(float(id(p) in decayed), dtype=p.dtype) for _, p in named]
        else:
            if zero == 3:  # each block a unit; embedding, final norm and head in the root
                self.wrapper = FullyShardedDataParallel(model, adam, units=list(model.blocks))
            else:
                self.wrapper = ZeroDataParallel(model, adam, stage=zero)
            self.optimizer = self.wrapper.optimizer
            self.masks = [_shard_mask(s, decayed) for s in self.wrapper.shards]
        self.weight_decay, self.precision = optim.weight_decay, config.train.precision

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss on its rows (the wrapper gathers what it must), the forward
        in the run's precision."""
        with autocast(self.precision):
            logits = self.wrapper(ids)
        wide = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        return nn.functional.cross_entropy(wide.flatten(0, 1), targets.flatten())

    def accumulating(self, last: bool):
        """The context for one accumulation chunk's backward: DDP holds its all-reduce
        until the last chunk (ZeRO-2/3 reduce-scatter each chunk as it comes)."""
        return self.wrapper.no_sync() if self.zero == 0 and not last else nullcontext()

    def reduce_gradients(self) -> None:
        """Every gradient this rank owns averaged over dp (DDP did it during backward)."""
        if self.zero:
            self.wrapper.reduce_gradients()

    def owned_gradients(self) -> list[torch.Tensor | None]:
        """The gradient entries this rank owns: all of them (DDP, replicated over dp) or
        its slices (ZeRO: distinct on every dp rank)."""
        return [p.grad for group in self.optimizer.param_groups for p in group["params"]]

    def norm_groups(self) -> list:
        """The groups whose ranks own distinct entries (a replicated gradient is counted
        once, not dp times)."""
        return [None] if self.zero and world_size() > 1 else []

    def update(self, lr: float) -> None:
        """Decoupled weight decay, the Adam step at rate `lr`, gradients dropped."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, mask in zip(params, self.masks, strict=True):
                p.mul_(1 - lr * self.weight_decay * mask)  # AdamW's first line, masked
        set_learning_rate(self.optimizer, lr)
        if self.zero:
            self.wrapper.update()  # the step, then (ZeRO-1/2) the parameters gathered
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def skip(self) -> None:
        """Drop this step's gradients without updating (an fp16 overflow)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.zero == 0:
            self.model.zero_grad(set_to_none=True)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, under the twin's names (a collective under ZeRO-3)."""
        if self.zero == 3:
            self.wrapper.gather_parameters()
        yield from ((n, p.detach()) for n, p in self.model.named_parameters())

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """No gradients and (DDP) no all-reduce for the validation loss."""
        with torch.no_grad():
            yield
