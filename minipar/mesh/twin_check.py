"""The decoder trained on a mesh (`MeshDecoder`), and checked against its one-process twin
rank by rank: lesson 07's composed training, the mesh demo, bench and tests.

The composition is the trainer's, from the same pieces (`train/model_part.py` adds
precision, recomputation, experts and AdamW's masks around them):
- `decoder_layers`: the embedding, the blocks cut over tp (Megatron's split by heads
  and by SwiGLU's width) and the head;
- `MeshModel`: the layers shared out as pipeline stages over pp, run by 1F1B, the tied
  embedding's two copies summed across the pipeline's ends;
- `StageDataParallel`: lesson 02's DDP (or lesson 06's ZeRO-1/2/3) over dp on each
  stage, reduced inside the stage's last backward.

Every rank builds the tiny float64 twin from one seed, cuts its part of it, and takes the
same Adam steps on the same batches as the whole twin; it reports the loss gap, and every
gradient (first step) and parameter (after the last) that is not its slice of the twin's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .. import collectives
from ..data_parallel import shard
from ..decoder import Decoder, DecoderConfig, decoder
from ..runtime import device, rank, world_size
from ..tensor_parallel import twin_slice
from .decoder_layers import decoder_layers, decoder_loss
from .mesh import Mesh, MeshGroups
from .model import MeshModel
from .stage_data_parallel import StageDataParallel

# four blocks (pp up to 4), four query heads on two kv heads (tp splits whole kv heads:
# tp = 4 takes kv_heads = 4), eight rows (dp up to 8)
TWIN = DecoderConfig(vocab_size=32, layers=4, hidden=16, heads=4, kv_heads=2, seq_len=8)
ROWS, LR = 8, 1e-2


class MeshDecoder:
    """This rank's part of a decoder `twin` on a mesh with dimensions dp, pp, tp (and cp of
    size 1), trained by Adam at `lr` with ZeRO stage `zero` over dp (0: DDP). The layers
    copy the twin's weights (this rank's slices of them): the twin stays whole."""

    def __init__(self, twin: Decoder, groups: MeshGroups, zero: int = 0,
                 microbatches: int = 2, lr: float = LR) -> None:
        self.zero, self.dp = zero, groups.dp

        def adam(params: list[nn.Parameter]) -> torch.optim.Adam:
            return torch.optim.Adam(params, lr=lr, foreach=False)

        def data_parallel(stages: dict[int, nn.Module], tied: nn.Parameter | None
                          ) -> StageDataParallel:
            # before the pipeline sees the parameters: ZeRO makes them views of its buffer
            return StageDataParallel(stages, zero, adam, groups.dp, tied)

        self.model = MeshModel(decoder_layers(twin, groups), groups, microbatches,
                               data_parallel=data_parallel)
        self.loss = decoder_loss(groups, twin.config.vocab_size)  # vocab-parallel over tp
        self.sharded = self.model.data_parallel
        self.optimizer = (self.sharded.optimizer if zero
                          else adam(list(self.model.local.parameters())))

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        """The whole batch's gradients, reduced over dp; its mean loss on the last stage's
        ranks (None elsewhere)."""
        dp, me = world_size(self.dp), rank(self.dp)
        # this replica's rows; its loss is their mean, and the average over dp the batch's
        loss = self.model.forward_backward(shard(ids, me, dp), shard(targets, me, dp),
                                           self.loss)
        self.sharded.reduce_gradients()  # what backward left: ZeRO-1's reduce-scatter
        self.model.sum_tied_gradients()  # after the reduction: the sum is of averages
        if loss is None:
            return None
        loss = torch.tensor([loss], dtype=torch.float64, device=device())
        return collectives.all_reduce(loss, op="avg", group=self.dp).item()

    def step(self) -> None:
        """Adam's step (ZeRO: each rank steps its slice, then the parameters are gathered;
        ZeRO-3 gathers at the next forward)."""
        if self.zero:
            self.sharded.update()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        loss = self.forward_backward(ids, targets)
        self.step()
        return loss


def check_against_twin(mesh_dims: dict[str, int], zero: int = 0, steps: int = 2,
                       microbatches: int = 2, seed: int = 3) -> dict:
    """Run on every rank of a launched mesh (`mesh_dims`: dp, pp and tp, each 1 when left
    out, in that order): train the twin for `steps` Adam steps on the mesh (ZeRO stage
    `zero` over dp) and on one process, from the same weights and batches; return the
    losses (ranks of the last stage), the largest gap to the twin's, the names of gradients
    (first step, without ZeRO, whose gradients are slices) and of parameters (after the
    last step) that differ, and this rank's coordinates."""
    groups = connect(mesh_dims)
    tp, tp_rank = world_size(groups.tp), rank(groups.tp)
    config = TWIN if TWIN.kv_heads % tp == 0 else replace(TWIN, kv_heads=TWIN.heads)
    twin = decoder(config, seed, torch.float64)
    mesh = MeshDecoder(twin, groups, int(zero), microbatches)
    reference = torch.optim.Adam(twin.parameters(), lr=LR, foreach=False)
    gen = torch.Generator().manual_seed(seed + 1)
    twin_params = dict(twin.named_parameters())
    gap, wrong_grads, losses = 0.0, [], []
    for step in range(steps):
        # the same seeded batch on any device
        ids, targets = [torch.randint(0, config.vocab_size, (ROWS, config.seq_len),
                                      generator=gen).to(device()) for _ in range(2)]
        loss = mesh.forward_backward(ids, targets)
        ref_loss = twin.loss(ids, targets)
        ref_loss.backward()
        if loss is not None:
            gap = max(gap, abs(loss - ref_loss.item()))
            losses.append(loss)
        if step == 0 and not zero:
            wrong_grads = [n for n, p in mesh.model.named_parameters() if not torch.allclose(
                p.grad, twin_slice(twin_params[n].grad, p, tp_rank, tp), rtol=1e-9,
                atol=1e-12)]
        mesh.step()
        reference.step()
        reference.zero_grad(set_to_none=True)
    if zero == 3:
        mesh.sharded.gather_parameters()  # ZeRO-3 frees them between steps
    # Adam divides each gradient by its own running size, so an entry whose gradient is
    # tiny turns rounding (summation order differs across ranks) into ~1e-12 of the lr-sized
    # step; a real mistake moves parameters by ~lr = 1e-2
    wrong_params = [n for n, p in mesh.model.named_parameters() if not torch.allclose(
        p.detach(), twin_slice(twin_params[n].detach(), p, tp_rank, tp), rtol=1e-9,
        atol=1e-10)]
    return {"coords": groups.coords, "losses": losses, "loss_gap": gap,
            "wrong_grads": wrong_grads, "wrong_params": wrong_params}


def connect(mesh_dims: dict[str, int]) -> MeshGroups:
    """The groups of a dp, pp, tp mesh in the order `mesh_dims` names them (the last
    fastest), with a cp dimension of size 1 that the decoder's layers read."""
    if set(mesh_dims) - {"dp", "pp", "tp"}:
        raise ValueError(f"mesh_dims takes dp, pp and tp; got {sorted(mesh_dims)} (context "
                         "and expert parallelism compose in `minipar train`)")
    return Mesh(**mesh_dims, cp=1).connect()
