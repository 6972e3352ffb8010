"""The GPU check: what minipar claims about GPUs, run on the GPUs there are, as a matrix
of cases each in launches of its own, in one command that needs no install (a bare GPU
machine with torch, numpy, matplotlib, cloudpickle):

    PYTHONPATH=. python3 -m minipar.gpu_check        (or: minipar gpu-check)

Each case starts its own ranks with its own timeout, so one hang or failure ends one
case and hides nothing; each is timed and reported alone, and a case that needs more
GPUs than there are is skipped with one line. The parts (cases.py lists every case):

1. One rank: a smoke test under NCCL and under gloo; `small` in fp32 and bf16 with
   tokens/s, MFU against the card's data sheet and the allocator's peak (bf16's loss
   within 5% of fp32's).
2. Point-to-point: K = 2, 3, 4, 8 ranks x every way the library posts messages (p2p_matrix.py)
   x 4 KiB, 4 MiB and 64 MiB, every value checked, timed on the device.
3. Collectives against torch's (NCCL's kernels): K = 2, 3, 5, 8, on a subgroup too, in
   five dtypes up to 256 MiB, all_to_all uneven with empty pieces (collectives_matrix.py).
4. Compositions under NCCL, one GPU per rank, each equal to one process in fp64 within
   1e-10: dp, ZeRO 1-3, HSDP, ep2, tp 2/4/8 with and without sp, pp 2/4/8 under every
   synchronous schedule (one with 16 MiB messages), cp ring and Ulysses, 3D, tied and
   untied, a resume onto another mesh; dp2 in bf16 under a loose bound.
5. One GPU shared by 2-8 gloo ranks (messages staged through the host), each equal to
   one process.
6. Streams: offloading's copy stream equal to training in memory, at a size where an
   unordered copy would lose its race; a profiler trace of DDP, FSDP prefetch and the
   tp overlap showing NCCL kernels under compute (streams_trace.py).
7. MFU and memory of a mid-size bf16 model (12 layers x 2048): the timed matmul at 70%
   or more of the data sheet, MFU at most 1, the allocator's peak holding its states.
8. `torchrun --nproc-per-node N`: the data-parallel trainers equal to one process.

It writes every case's status, time and lines to a JSON report (`--report`). Without
CUDA it says so in one line and exits 0 (CI has no GPU). `--on-cpu` runs on gloo CPU
ranks what can run there, with small sizes, which tests the check's own code.
"""

from .cases import PARTS, CheckCase, cases
from .runner import CaseResult, main, parts_here, run_case, run_check

__all__ = ["PARTS", "CaseResult", "CheckCase", "cases", "main", "parts_here", "run_case",
           "run_check"]
