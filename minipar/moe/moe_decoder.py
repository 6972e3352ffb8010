"""The decoder with a mixture of experts in every block (`DecoderConfig.experts > 0`):
the one-process twin, and its block cut over a mesh's `ep` dimension.

The twin's feed-forward is MegaBlocks' dropless routing (`DroplessMoE`): every token's
top-k choices are kept, so no capacity depends on how the tokens are grouped, and expert
parallelism over any number of ranks computes exactly what one process does. On a mesh,
each block's experts are split over the `ep` ranks (`ExpertParallelMoE`: tokens travel by
all-to-all), while ep sits inside data parallelism as `moe.on_mesh` lays it out: the
ep ranks hold different rows of the batch, so the dense weights (attention, norms, the
router) are averaged over dp and ep, an expert's gradient over dp only, divided by ep.
Balancing the experts while training (balance.py: the auxiliary loss or the
loss-free bias, counts over the global batch) hooks into the trainer's feed-forward
(`balance_experts`); without it the objective is the cross-entropy alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from ..decoder import Decoder, DecoderBlock, DecoderConfig
from ..mesh import MeshGroups
from .balance import LoadBalance
from .dropless import DroplessMoE
from .expert_parallel import ExpertParallelMoE


class MoEFeedForward(DroplessMoE):
    """A block's feed-forward as a dropless mixture of experts: [batch, seq, hidden] in and
    out, every token routed on its own."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype = torch.float32) -> None:
        # MoELayer seeds torch's global generator; the decoder draws its own weights from
        # its seed afterwards (Decoder.init), so keep the caller's generator as it was
        with torch.random.fork_rng(devices=[]):
            super().__init__(config.hidden, config.ffn, config.experts, k=config.top_k,
                             dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)


class MoEDecoderBlock(DecoderBlock):
    """The decoder's block with `MoEFeedForward` as its mlp."""

    def make_mlp(self, config: DecoderConfig, dtype: torch.dtype) -> nn.Module:
        return MoEFeedForward(config, dtype)


class MoEDecoder(Decoder):
    """The decoder whose every block is a `MoEDecoderBlock`."""

    make_block = MoEDecoderBlock


def moe_decoder(config: DecoderConfig, seed: int = 0, dtype: torch.dtype = torch.float32
                ) -> Decoder:
    """The twin for `config`: the plain Decoder when experts = 0, else MoEDecoder."""
    return (MoEDecoder if config.experts else Decoder)(config, seed, dtype)


class ExpertParallelFeedForward(ExpertParallelMoE):
    """This rank's experts of a block's `MoEFeedForward`, over the `ep` group; with a
    `balance` (`balance_experts`), balanced as it says."""

    balance: LoadBalance | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        return y if self.balance is None else self.balance.after_routing(self.last_routing, y)


def balance_experts(layers: nn.Module, kind: str, coef: float, rate: float, group,
                    device: torch.device | None = None) -> list[ExpertParallelFeedForward]:
    """Give every expert-parallel feed-forward in `layers` a LoadBalance of `kind` (its
    counts all-reduced over `group`, the ranks holding other tokens); for "bias", its
    routing rule becomes the biased one. Returns them, in module order."""
    found = [m for m in layers.modules() if isinstance(m, ExpertParallelFeedForward)]
    for ff in found:
        ff.balance = LoadBalance(ff.num_experts, kind, coef, rate, group, device)
        if kind == "bias":
            ff.rule = ff.balance.rule(ff.rule.k, ff.rule.order)
    return found


class ExpertParallelBlock(nn.Module):
    """A twin block whose feed-forward's experts live on the ep ranks; its parameters are
    named as the twin's (this rank's expert i is the twin's expert first + i)."""

    def __init__(self, twin: MoEDecoderBlock, ep_group) -> None:
        super().__init__()
        # the block without its feed-forward: the memo hands deepcopy a placeholder for the
        # twin's mlp, so all E experts are not copied only to be replaced
        self.block = copy.deepcopy(twin, memo={id(twin.mlp): nn.Identity()})
        self.block.mlp = ExpertParallelFeedForward(twin.mlp, ep_group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                explicit: bool | None = None) -> torch.Tensor:
        return self.block(x, cos, sin, explicit)

    def experts(self) -> list[nn.Parameter]:
        """The parameters of this rank's experts (averaged over dp only)."""
        return list(self.block.mlp.experts.parameters())

    def twin_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The twin's names: the block's own, the experts renumbered as the twin's."""
        mark, first = "mlp.experts.", self.block.mlp.first
        for name, p in self.block.named_parameters():
            if name.startswith(mark):
                index, rest = name[len(mark):].split(".", 1)
                name = f"{mark}{first + int(index)}.{rest}"
            yield name, p


def cut_expert_parallel(block: nn.Module, groups: MeshGroups) -> nn.Module:
    """`mesh.decoder_layers`' block cut for a mixture-of-experts decoder: experts over ep
    (tensor and context parallelism are not composed with experts here: the trainer's
    `refuse_unbuilt` says so in one line)."""
    return ExpertParallelBlock(block, groups.ep)
