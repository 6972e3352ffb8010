"""`--compile`: torch.compile each decoder block, as torchtitan does.

One block is the unit: every layer of a decoder has the same shapes, so the first layer's
compiled graph serves the others (dynamo guards on the code and shapes, not on which
weights), and the compile time is one block's, not the whole model's. Inductor fuses each
block's elementwise work (RMSNorm, the rotary embedding, SwiGLU's gate) into a few
kernels around the matmuls, which it leaves to the BLAS. Compiling in place
(`nn.Module.compile`) keeps every parameter's name, so checkpoints, exports and the
twin's names are those of an eager run.

Where it breaks the graph: at minipar's own autograd Functions and the collectives
inside them (tensor parallelism's column and row linears, sequence parallelism's
gathers: their trace clock and message tags are Python builtins dynamo does not trace),
which run eagerly between the compiled pieces. Not composed (one line says so): context
parallelism and experts (`refuse_uncompilable`). The arithmetic is the
same as eager up to the order of float32 sums in the fused kernels.

It pays on a GPU, where a step's many small kernels each cost a launch; on a CPU the
first step pays the C++ compile (tens of seconds per rank), and later steps run faster.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

from ..mesh.decoder_layers import DecoderLayer

if TYPE_CHECKING:
    from .config import TrainConfig


def refuse_uncompilable(config: TrainConfig) -> None:
    """One line for what `--compile` does not compose with: context parallelism (ring
    attention's messages inside the block trip one of dynamo's guards) and experts (the
    dispatch's row counts are data, which inductor cannot compile around)."""
    if not config.train.compile:
        return
    if config.parallel.cp > 1 or config.model.experts:
        raise ValueError(f"train.compile with cp={config.parallel.cp}, experts="
                         f"{config.model.experts}: ring attention and the experts' dispatch "
                         "are not compiled; use cp = 1 and no experts, or leave --compile off")


def compile_blocks(model: nn.Module) -> int:
    """Compile, in place, the block of every DecoderLayer in `model` (this rank's part of
    the mesh); the number compiled."""
    # dynamo warns, on every rank, at each Python builtin it cannot trace; in a block those
    # are the expected graph breaks (the module docstring): the trace's clock, message tags
    warnings.filterwarnings("ignore", message="Dynamo does not know how to trace the builtin")
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.block.compile()
    return len(layers)
