"""The peak MFU divides by, on whatever the run computes on.

On a CPU no data sheet gives a core's peak for these shapes and threads: the peak is the
model's own kernels timed here on one core (`matmul_peak.model_peak`: the faster of its
matmuls and its fused attention), times the cores in use. A bf16 or fp16 run on a CPU
also times the same matmuls in float32: a CPU without fast low-precision kernels
multiplies them many times slower, and the run says so first.

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

from ..decoder import DecoderConfig
from ..runtime import cpu_kind, device, device_name, rank, world_size
from .matmul_peak import matmul_rates, model_peak, square_peak
from .metrics import cores_in_use

TFLOPS = 1e12

# dense (no 2:4 sparsity) peaks, TFLOP/s, from NVIDIA's data sheets (each row names its
# sheet; where a sheet gives "with sparsity", half of it). float32 is the CUDA cores'
# figure: torch multiplies float32 without TF32 unless told to
# (torch.backends.cuda.matmul.allow_tf32); float64 is the tensor cores' where they have it.
# Keyed by (model, form factor) as `card` reads them from torch's name for the card: a
# whole word, so an L40 never gets the L4's row, nor an H200 NVL the H200 SXM's.
BF, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DATASHEET: dict[tuple[str, str], tuple[dict[torch.dtype, float], str]] = {
    ("H100", "SXM"): ({BF: 989.4, FP16: 989.4, FP32: 66.9, FP64: 66.9},
                      "H100 Tensor Core GPU datasheet, SXM column"),
    ("H100", "PCIe"): ({BF: 756.5, FP16: 756.5, FP32: 51.2, FP64: 51.2},
                       "H100 Tensor Core GPU datasheet, PCIe column"),
    ("H100", "NVL"): ({BF: 835.5, FP16: 835.5, FP32: 60.0, FP64: 60.0},
                      "H100 Tensor Core GPU datasheet, H100 NVL column"),
    ("H200", "SXM"): ({BF: 989.4, FP16: 989.4, FP32: 66.9, FP64: 66.9},
                      "H200 Tensor Core GPU datasheet, H200 SXM column"),
    ("H200", "NVL"): ({BF: 835.5, FP16: 835.5, FP32: 60.0, FP64: 60.0},
                      "H200 Tensor Core GPU datasheet, H200 NVL column"),
    ("A100", "SXM"): ({BF: 312.0, FP16: 312.0, FP32: 19.5, FP64: 19.5},
                      "A100 Tensor Core GPU datasheet (SXM and PCIe alike)"),
    ("A100", "PCIe"): ({BF: 312.0, FP16: 312.0, FP32: 19.5, FP64: 19.5},
                       "A100 Tensor Core GPU datasheet (SXM and PCIe alike)"),
    ("A10", "PCIe"): ({BF: 125.0, FP16: 125.0, FP32: 31.2}, "NVIDIA A10 datasheet"),
    ("L40S", "PCIe"): ({BF: 362.05, FP16: 362.05, FP32: 91.6}, "NVIDIA L40S datasheet"),
    ("L40", "PCIe"): ({BF: 181.05, FP16: 181.05, FP32: 90.5}, "NVIDIA L40 datasheet"),
    ("L4", "PCIe"): ({BF: 121.0, FP16: 121.0, FP32: 30.3}, "NVIDIA L4 datasheet"),
    ("T4", "PCIe"): ({FP16: 65.0, FP32: 8.1}, "NVIDIA T4 datasheet (no bf16 units)"),
    ("V100", "SXM"): ({FP16: 125.0, FP32: 15.7, FP64: 7.8}, "V100 datasheet, SXM2 column"),
    ("V100", "PCIe"): ({FP16: 112.0, FP32: 14.0, FP64: 7.0}, "V100 datasheet, PCIe column"),
}
# the form factor a card's name implies when it names none: NVIDIA's names for the SXM
# boards carry no "SXM" ("NVIDIA H100 80GB HBM3", "NVIDIA H200"); the others are PCIe cards
_PLAIN_FORM = {"H100": "SXM", "H200": "SXM", "A100": "SXM", "V100": "SXM"}


def card(name: str) -> tuple[str, str] | None:
    """(model, form factor) of a card as torch names it ("NVIDIA H200 NVL" -> ("H200",
    "NVL"), "NVIDIA A100-SXM4-80GB" -> ("A100", "SXM")), or None for a name with no
    model from DATASHEET as a whole word."""
    words = name.upper().replace("-", " ").split()
    models = {m for m, _ in DATASHEET}
    model = next((w for w in words if w in models), None)
    if model is None:
        return None
    if "NVL" in words:
        form = "NVL"
    elif "PCIE" in words:
        form = "PCIe"
    elif any(w.startswith("SXM") for w in words):
        form = "SXM"
    else:
        form = _PLAIN_FORM.get(model, "PCIe")
    return model, form


def datasheet_peak(name: str, dtype: torch.dtype) -> float | None:
    """The data sheet's dense FLOP/s of the card `name` (as torch names it) in `dtype`;
    None for a card not in `DATASHEET` (MFU then divides by the timed matmul, and the run
    says so), or a dtype its sheet gives no figure for."""
    row = DATASHEET.get(card(name) or ("", ""))
    if row is None or dtype not in row[0]:
        return None
    return row[0][dtype] * TFLOPS


@dataclass
class Peak:
    """What MFU divides by: `per_device` FLOP/s times `devices`, and where it came from."""

    dtype: torch.dtype  # the dtype the run's matmuls run in
    measured: float  # timed on this device, per device: a GPU's matmul, a CPU's model_peak
    datasheet: float | None  # the maker's figure, for a card in DATASHEET
    devices: int
    name: str  # the device, as its maker names it
    unit: str  # what one device is: "core" or "GPU"
    # a CPU run's matmuls as the model calls them (`Rates.as_run`): in its own dtype, and
    # for a low-precision run in float32 too (the warning compares the two)
    fp32: float | None = None
    matmuls: float | None = None

    @property
    def per_device(self) -> float:
        """The data sheet's figure where there is one, else the timed peak."""
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
        if self.unit == "GPU":
            return head + f"a {kind} matmul timed here on {self.name}; no data sheet known " \
                          "for this card"
        return head + f"the faster of the model's {kind} matmuls and its fused attention, " \
                      f"timed here at their best on {self.name}, {cpu_kind()}"

    def warning(self) -> str | None:
        """One line before a CPU run whose low-precision matmuls are slower than float32's
        on the same shapes (a CPU without AMX or AVX512-BF16 has no fast bf16 kernel)."""
        low = self.measured if self.matmuls is None else self.matmuls
        if self.fp32 is None or low >= self.fp32:
            return None
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        return f"warning: {precision_verdict(kind, low / self.fp32)}; " \
               "--precision fp32 trains faster here"


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


# the units that multiply each low precision fast on a CPU
FAST_UNITS = {"bf16": "AMX or AVX512-BF16", "fp16": "AMX-FP16 or AVX512-FP16"}


def precision_verdict(kind: str, ratio: float) -> str:
    """What `kind`'s ("bf16", "fp16") matmul rate `ratio` x float32's means on this CPU."""
    if ratio >= 1.2:
        return f"{kind} matmuls run {ratio:.1f}x faster than fp32 on this CPU ({cpu_kind()})"
    if ratio >= 0.8:
        return f"{kind} matmuls run at about fp32's rate ({ratio:.2f}x) on this CPU " \
               f"({cpu_kind()}): {kind} saves memory here, not time"
    return f"{kind} matmuls run {1 / ratio:.0f}x slower than fp32 on this CPU " \
           f"({cpu_kind()}: no {FAST_UNITS[kind]})"


def run_peak(dtype: torch.dtype, model: DecoderConfig, rows: int) -> Peak:
    """The run's peak (every rank calls it together), timed by rank 0 alone (ranks timing
    at once would slow each other) and sent to the others: on a CPU the model's kernels
    at `rows` sequences per pass (`model_peak`; and the matmuls alone as the model calls
    them, in the run's dtype, and for a low-precision run in float32 too); on a GPU one
    large matmul, beside the data sheet's figure for a known card."""
    gpu = device().type == "cuda"
    box: list = [None]
    if rank() == 0:
        low = dtype in (torch.bfloat16, torch.float16) and not gpu
        box = [(square_peak(dtype) if gpu else model_peak(dtype, model, rows),
                matmul_rates(torch.float32, model, rows).as_run if low else None,
                None if gpu else matmul_rates(dtype, model, rows).as_run)]
    if world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    (measured, fp32, matmuls), name = box[0], device_name()
    return Peak(dtype, measured, datasheet_peak(name, dtype) if gpu else None,
                devices_in_use(world_size()), name, "GPU" if gpu else "core", fp32, matmuls)
