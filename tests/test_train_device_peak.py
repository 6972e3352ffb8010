"""What MFU divides by (issue 43): on a CPU a matmul timed on one core times the cores; on
a known GPU the data sheet's dense figure for the run's dtype, the timed matmul beside it;
on an unknown GPU the timed matmul, said so."""

import torch

from minipar.train.device_peak import DATASHEET, TFLOPS, Peak, datasheet_peak, run_peak
from minipar.train.metrics import cores_in_use


def test_each_card_finds_its_own_row_not_a_shorter_name_inside_it():
    assert datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4 * TFLOPS
    assert datasheet_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756.5 * TFLOPS
    assert datasheet_peak("NVIDIA H200", torch.float32) == 66.9 * TFLOPS
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312 * TFLOPS
    assert datasheet_peak("NVIDIA A10", torch.bfloat16) == 125 * TFLOPS  # not A100's
    assert datasheet_peak("NVIDIA L4", torch.float16) == 121 * TFLOPS  # not L40S's
    assert datasheet_peak("NVIDIA L40S", torch.float16) == 362.05 * TFLOPS
    assert datasheet_peak("Tesla T4", torch.bfloat16) is None  # no bf16 units
    assert datasheet_peak("Some Future GPU", torch.bfloat16) is None
    # a longer name is never hidden behind a shorter fragment listed before it
    fragments = [f for f, _ in DATASHEET]
    for i, f in enumerate(fragments):
        assert not any(g in f for g in fragments[:i]), (f, fragments[:i])


def test_on_a_cpu_mfu_divides_by_the_timed_matmul_times_the_cores():
    peak = run_peak(torch.float32)
    assert peak.datasheet is None and peak.unit == "core"
    assert peak.per_device == peak.measured > 0 and peak.devices == cores_in_use(1) == 1
    line = peak.describe()
    assert line.startswith("peak ") and "a float32 matmul timed here on CPU" in line


def test_the_head_line_says_which_peak_a_gpu_run_divides_by():
    known = Peak(torch.bfloat16, 742e12, 989.4 * TFLOPS, 2, "NVIDIA H100 80GB HBM3", "GPU")
    assert known.total == 2 * 989.4 * TFLOPS
    assert known.describe() == (
        "peak       989.4 TFLOP/s per GPU x 2 (MFU divides by it): NVIDIA H100 80GB HBM3's "
        "data sheet, bfloat16; a bfloat16 matmul timed here reaches 742, 75% of it")
    unknown = Peak(torch.bfloat16, 50e12, None, 1, "Some Future GPU", "GPU")
    assert unknown.describe().endswith("no data sheet known for this card")
