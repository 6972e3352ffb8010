"""Memory per rank by kind (parameters, gradients, optimizer state, activations): measured
in one untimed step at the end of a run (`memory_by_kind`, lesson 06's MemoryTracker),
beside what the cost model predicts for the same config (`predicted_memory`, the
planner's formulas from cost.py).

The measured step is the one an fp16 overflow takes: forward and backward of a held-out
batch, the gradients reduced, then dropped (`ModelPart.skip`): no update, the training
sampler untouched, so the run is the same with or without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from .. import cost
from ..report import format_table
from ..runtime import memory_peak, rank, world_size
from ..sharded.memory_tracker import KINDS, MemoryTracker
from .config import TrainConfig
from .model_part import ModelPart, trainer_mesh
from .precision import LossScaler

MIB = 2**20


def memory_by_kind(part: ModelPart, ids: torch.Tensor, targets: torch.Tensor,
                   batch: int) -> dict[str, int]:
    """Bytes this rank held during one forward and backward of `ids` (this rank's rows of
    a `batch`-row global batch), each kind at its own peak over the step (activations
    peak after forward, gradients after backward: the sum bounds the step's peak from
    above). A collective: every rank of the run calls it together."""
    shards = part.sharded.shards if part.sharded is not None else ()
    tracker = MemoryTracker(part.module, part.optimizer, shards)
    pipe = part.model.pipe
    meter = pipe.activations
    meter.peak = meter.now  # the pipeline's meter keeps the run's peak: from here on
    pipe.measure_activations = True  # for this step only: its hooks cost time
    with tracker.watch():
        part.forward_backward(ids, targets, batch, LossScaler(False), last=True)
        tracker.sample("after backward")
        part.reduce_gradients()
        tracker.sample("after the reduction")
    pipe.measure_activations = False
    part.skip()  # the gradients dropped, no update: the run goes on as if unmeasured
    peak = {kind: max(getattr(s, kind) for s in tracker.samples) for kind in KINDS}
    # Inside the engine a stage's forward runs under the meter's own saved-tensor hooks,
    # which hide what autograd saves from the tracker's (the innermost hooks win): the
    # meter is the one that sees a pipeline's activations, every micro-batch in flight.
    peak["activations"] = meter.peak
    return peak


def _dtype_name(config: TrainConfig) -> str:
    # the trainer keeps its weights, gradients and Adam's state in float32 for fp32, bf16
    # and fp16 (autocast computes in 16 bits; precision.PARAM_DTYPES) and float64 for fp64
    return "fp64" if config.train.precision == "fp64" else "fp32"


def predicted_memory(config: TrainConfig) -> dict[str, float]:
    """Bytes per rank by kind as the planner counts them (`mesh.planner.estimate`), for
    the trainer's numerics. Assumptions: the parameters (`DecoderConfig.parameters`, exact
    for the whole model) split evenly over pp x tp; Adam's two states in the weights'
    dtype and no separate master copy; ZeRO's division over dp (`cost.zero_memory`);
    activations by Korthikanti's formula (`cost.activation_bytes`, 16-bit, rescaled to the
    weights' dtype) for a micro-batch of batch / (dp x accumulation x microbatches) rows,
    ceil(layers / pp) layers, min(pp, microbatches) micro-batches in flight (1F1B), seq_len
    / cp tokens per rank, split over tp as Korthikanti's Eq. 2 splits them (all of them
    under sequence parallelism). Left out, where a measurement differs: the norms are
    replicated over tp (the blocks' matrices, the embedding and the head are split), a
    tied embedding has a copy on both pipeline ends, ZeRO pads each flat shard to a
    multiple of dp, and the formula's activations are Megatron's (dropout masks, 16-bit
    softmax), not this decoder's."""
    m, p, t = config.model, config.parallel, config.train
    dtype = _dtype_name(config)
    params = m.parameters() / (p.pp * p.tp)
    states = cost.zero_memory(cost.training_memory(params, weights=dtype, grads=dtype,
                                                   optimizer="adam", optimizer_dtype=dtype),
                              p.zero, p.dp)
    micro_batch = t.batch_size // (p.dp * t.accumulation * p.microbatches)
    in_flight = min(p.pp, p.microbatches)
    activations = cost.activation_bytes(math.ceil(m.layers / p.pp), m.hidden, m.seq_len // p.cp,
                                        micro_batch, m.heads, t.recompute, tp=p.tp,
                                        sequence_parallel=p.sequence_parallel)
    activations *= in_flight * cost.DTYPE_BYTES[dtype] / 2  # the formula counts 16-bit values
    return {"parameters": states.weights, "gradients": states.gradients,
            "optimizer": states.optimizer, "activations": activations}


def memory_rows(part: ModelPart, config: TrainConfig, ids: torch.Tensor,
                targets: torch.Tensor) -> tuple[dict, list[dict]]:
    """This rank's row (rank, mesh coordinates, measured and predicted bytes by kind and,
    on a GPU, the allocator's peak over the run) and, on rank 0, every rank's (others get
    []). A collective, as `memory_by_kind`."""
    mine = {"rank": rank(), "coords": trainer_mesh(config).coords(rank()),
            "measured": memory_by_kind(part, ids, targets, config.train.batch_size),
            "predicted": predicted_memory(config),
            # torch.cuda.max_memory_allocated: every tensor, workspaces and buffers too
            "allocator_peak": memory_peak()}
    if world_size() == 1:
        return mine, [mine]
    everyone = [None] * world_size() if rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return mine, everyone if rank() == 0 else []


def memory_table(rows: list[dict]) -> str:
    """MiB per kind, measured / predicted, one line per rank."""
    shown, dims = [], [k for k in rows[0]["coords"] if any(r["coords"][k] for r in rows)]
    for row in rows:
        where = " ".join(f"{k}{row['coords'][k]}" for k in dims) or "the only rank"
        cells = {kind: f"{row['measured'][kind] / MIB:.3f} / {row['predicted'][kind] / MIB:.3f}"
                 for kind in KINDS}
        peak = row.get("allocator_peak")
        shown.append({"rank": f"{row['rank']} ({where})", **cells,
                      "allocator": "" if peak is None else f"{peak / MIB:.3f}"})
    # the allocator's column only where there is one: torch counts no peak on a CPU
    allocator = [("allocator", "allocator peak")] if any(r["allocator"] for r in shown) else []
    return ("memory per rank, MiB, measured (each kind at its peak in one step) / predicted "
            "(the planner's formulas)"
            + ("; allocator peak: the most torch held on the GPU over the run" if allocator
               else "") + "\n"
            + format_table(shown, [("rank", "rank"), *[(k, k) for k in KINDS], *allocator]))


def save_memory(out: Path, rows: list[dict]) -> str:
    """Write every rank's row to `out`/memory.json; the table to print."""
    (out / "memory.json").write_text(json.dumps(rows, indent=1))
    return memory_table(rows)
