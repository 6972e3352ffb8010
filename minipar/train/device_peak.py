"""The peak MFU divides by, on whatever the run computes on.

On a CPU no data sheet gives a core's peak for these shapes and threads: the peak is a
matmul timed here on one core (`metrics.measured_peak`), times the cores in use.

On a GPU the convention every report follows (PaLM's appendix B, Megatron, torchtitan) is
the maker's dense peak for the dtype the matmuls run in: MFU then compares across papers
and machines. So for a card in `DATASHEET` MFU divides by its figure, and the matmul
timed on the card is reported beside it (how much of the data sheet a large matmul
reaches here); for a card not in the table, by the timed matmul, and the run says so.
Either way the peak is per device, times the devices in use: ranks that share one GPU
(gloo with device="cuda") share its peak.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import device, device_name, rank, world_size
from .metrics import cores_in_use, measured_peak

TFLOPS = 1e12

# dense (no 2:4 sparsity) peaks, TFLOP/s, from NVIDIA's data sheets. float32 is the CUDA
# cores' figure: torch multiplies float32 without TF32 unless told to
# (torch.backends.cuda.matmul.allow_tf32); float64 is the tensor cores' where they have it.
# Matched by the first fragment found in torch's name for the card, so "A100" comes
# before "A10", "L40S" before "L4" and the H100 PCIe and NVL before the H100 (SXM5).
DATASHEET: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    ("H100 PCIe", {torch.bfloat16: 756.5, torch.float16: 756.5, torch.float32: 51.2,
                   torch.float64: 51.2}),
    ("H100 NVL", {torch.bfloat16: 835.5, torch.float16: 835.5, torch.float32: 60.0,
                  torch.float64: 60.0}),
    ("H100", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9,
              torch.float64: 66.9}),  # SXM5
    ("H200", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9,
              torch.float64: 66.9}),  # SXM
    ("A100", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5,
              torch.float64: 19.5}),  # SXM4 and PCIe alike
    ("A10", {torch.bfloat16: 125.0, torch.float16: 125.0, torch.float32: 31.2}),
    ("L40S", {torch.bfloat16: 362.05, torch.float16: 362.05, torch.float32: 91.6}),
    ("L4", {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3}),
    ("T4", {torch.float16: 65.0, torch.float32: 8.1}),  # no bf16 units
    ("V100", {torch.float16: 125.0, torch.float32: 15.7, torch.float64: 7.8}),  # SXM2
)


def datasheet_peak(name: str, dtype: torch.dtype) -> float | None:
    """The data sheet's dense FLOP/s of the card `name` (as torch names it) in `dtype`;
    None for a card not in `DATASHEET`, or a dtype its sheet gives no figure for."""
    for fragment, peaks in DATASHEET:
        if fragment in name:
            return peaks[dtype] * TFLOPS if dtype in peaks else None
    return None


@dataclass
class Peak:
    """What MFU divides by: `per_device` FLOP/s times `devices`, and where it came from."""

    dtype: torch.dtype  # the dtype the run's matmuls run in
    measured: float  # the matmul timed on this device, per device
    datasheet: float | None  # the maker's figure, for a card in DATASHEET
    devices: int
    name: str  # the device, as its maker names it
    unit: str  # what one device is: "core" or "GPU"

    @property
    def per_device(self) -> float:
        """The data sheet's figure where there is one, else the timed matmul."""
        return self.datasheet or self.measured

    @property
    def total(self) -> float:
        return self.per_device * self.devices

    def describe(self) -> str:
        """The run's head line: the peak MFU divides by, and where it came from."""
        kind = str(self.dtype).removeprefix("torch.")
        head = (f"{'peak':<10} {self.per_device / TFLOPS:.4g} TFLOP/s per {self.unit} x "
                f"{self.devices} (MFU divides by it): ")
        if self.datasheet:
            return (head + f"{self.name}'s data sheet, {kind}; a {kind} matmul timed here "
                    f"reaches {self.measured / TFLOPS:.4g}, "
                    f"{self.measured / self.datasheet:.0%} of it")
        why = "; no data sheet known for this card" if self.unit == "GPU" else ""
        return head + f"a {kind} matmul timed here on {self.name}{why}"


def devices_in_use(ranks: int) -> int:
    """Devices the run computes on: on a GPU the distinct cards of its ranks (several
    ranks may share one); on a CPU the cores (`cores_in_use`). A collective on GPUs."""
    if device().type != "cuda":
        return cores_in_use(ranks)
    mine = (socket.gethostname(), device().index)
    if world_size() == 1:
        return 1
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, mine)
    return len(set(everyone))


def run_peak(dtype: torch.dtype) -> Peak:
    """The run's peak (every rank calls it together): the matmul timed by rank 0 alone
    (ranks timing at once would slow each other) and sent to the others, the data sheet's
    figure for a known GPU, and the devices in use."""
    box = [measured_peak(dtype) if rank() == 0 else None]
    if world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    name, gpu = device_name(), device().type == "cuda"
    return Peak(dtype, box[0], datasheet_peak(name, dtype) if gpu else None,
                devices_in_use(world_size()), name, "GPU" if gpu else "core")
