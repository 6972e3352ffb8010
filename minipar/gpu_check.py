"""The GPU check: what minipar claims about GPUs, run on the GPUs there are, in one command
that needs no install (a bare GPU machine with torch, numpy, matplotlib, cloudpickle):

    PYTHONPATH=. python3 -m minipar.gpu_check        (or: minipar gpu-check)

Its parts, each a claim and the test of it:
1. One GPU, one rank: the `small` preset trains in fp32 and in bf16 on the GPU. Each
   reports tokens/s, MFU against the GPU's peak (device_peak.py: the data sheet's, the
   timed matmul beside it), and memory: the tracker's kinds, the planner's prediction and
   the allocator's peak (torch.cuda.max_memory_allocated). bf16's loss curve stays within
   BF16_BOUND of fp32's; no MFU is above 1; the allocator held at least the weights,
   gradients and Adam's state (the model really is on the GPU).
2. One GPU, several ranks over gloo (`device="cuda"`, messages staged through the host):
   dp2, tp2, pp2, dp2 x tp2 and cp2 of the `tiny` preset in fp64, each equal to one
   process on the GPU within compare.py's fp64 bound.
3. The offload copy stream: parameters and Adam's state on the host (pinned) and
   activations swapped out and back on a second CUDA stream ordered by events; training
   equals training in memory.
4. Two or more GPUs (skipped with fewer): NCCL, one GPU per rank: minipar's collectives
   against torch's own, and the trainer's dp2, tp2 and pp2 (and dp2 x tp2 and cp2 with
   four) equal to one process. This part has not yet run anywhere: the sessions that
   built it had one GPU at most.

Without CUDA it says so in one line and exits 0 (CI has no GPU). `--on-cpu` runs parts
1-3 on CPU ranks with the `tiny` preset instead, which tests the check's own code.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from .cli import run_command
from .runtime import gpu_count, launch

BF16_BOUND = {"small": 0.05, "tiny": 0.05}  # largest |bf16 - fp32| / fp32 loss, any step
STEPS = {"small": 200, "tiny": 8}
COMPOSITIONS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, microbatches=2),
                "dp2 x tp2": dict(dp=2, tp=2), "cp2": dict(cp=2)}
NCCL_COMPOSITIONS = ("dp2", "tp2", "pp2")  # with 2 GPUs; all of COMPOSITIONS with 4
MIB = 2**20


# each part, and the GPUs it needs: what `minipar doctor` and `run_check` both read
PARTS = (("1. one GPU, one rank", 1), ("2. one GPU, ranks over gloo", 1),
         ("3. the offload copy stream", 1), ("4. NCCL over 2+ GPUs", 2))


def _skipped(needs: int, gpus: int) -> str | None:
    """Why a part needing `needs` GPUs does not run on `gpus`, or None when it runs."""
    if gpus >= needs:
        return None
    return "no GPU" if gpus == 0 and needs == 1 else f"needs {needs} GPUs, {gpus} here"


def parts_here(gpus: int | None = None) -> list[tuple[str, str]]:
    """(part, what this machine does with it): what `minipar doctor` prints."""
    gpus = gpu_count() if gpus is None else gpus
    return [(name, "runs" if (why := _skipped(needs, gpus)) is None else f"skipped: {why}")
            for name, needs in PARTS]


def _config(preset: str, **overrides):
    from .train.config import load_config

    steps = STEPS[preset]
    return load_config(preset, {"train.steps": steps, "train.eval_every": 0,
                                "optim.warmup_steps": min(50, steps // 4), **overrides})


def _one_rank(preset: str, device: str) -> list[str]:
    """Part 1: fp32 and bf16 on one rank; the measured lines, or AssertionError."""
    from .train.loop import train

    lines, losses = [], {}
    for precision in ("fp32", "bf16"):
        config = _config(preset, **{"train.precision": precision})
        with tempfile.TemporaryDirectory() as out:
            run = launch(train, 1, config, out, backend="gloo", device=device,
                         timeout=600)[0]
        losses[precision] = run.losses
        steady = run.records[len(run.records) // 4:]  # past the first steps' warm-up
        tokens = sum(r["tokens_per_s"] for r in steady) / len(steady)
        mfu = max(r["mfu"] for r in run.records)
        mem = run.memory
        states = sum(mem["measured"][k] for k in ("parameters", "gradients", "optimizer"))
        allocator = mem.get("allocator_peak")
        lines.append(f"{precision}: {tokens:,.0f} tokens/s, MFU {mfu:.1%} at most")
        lines.append(f"  {run.peak.describe()}")
        lines.append(f"  memory MiB: tracker {sum(mem['measured'].values()) / MIB:.1f}, "
                     f"planner {sum(mem['predicted'].values()) / MIB:.1f}, allocator peak "
                     + ("none on a CPU" if allocator is None else f"{allocator / MIB:.1f}"))
        assert 0 < mfu <= 1, f"{precision}: MFU {mfu:.2f} is above 1: the peak is wrong"
        assert allocator is None or allocator >= states, \
            f"{precision}: the GPU's allocator held {allocator} bytes, less than the " \
            f"weights, gradients and Adam's state ({states}): the model is not on the GPU"
    gap = max(abs(b - f) / f for f, b in zip(losses["fp32"], losses["bf16"], strict=True))
    bound = BF16_BOUND[preset]
    lines.append(f"bf16 vs fp32: largest relative loss gap {gap:.2%} over {STEPS[preset]} "
                 f"steps (bound {bound:.0%})")
    assert gap <= bound, f"bf16's loss left fp32's by {gap:.2%}, more than {bound:.0%}"
    return lines


def _compositions(names: tuple[str, ...], backend: str, device: str) -> list[str]:
    """Parts 2 and 4: each composition in fp64 equal to one process on the same device."""
    from .train.compare import FIXED_TOLERANCES, compare_losses, ranks_of
    from .train.loop import train

    base = _config("tiny", **{"train.precision": "fp64"})
    one = launch(train, 1, base, backend="gloo", device=device, timeout=600)[0].losses
    lines = []
    for name in names:
        config = replace(base, parallel=replace(base.parallel, **COMPOSITIONS[name]))
        runs = launch(train, ranks_of(config), config, backend=backend, device=device,
                      timeout=600)
        gap = compare_losses(next(r for r in runs if r.records).losses, one)
        lines.append(f"{name}: largest gap to one process {gap.largest:.1e} "
                     f"(bound {FIXED_TOLERANCES['fp64']:.0e})")
        assert gap.largest <= FIXED_TOLERANCES["fp64"], f"{name} differs from one process"
    return lines


def _offload() -> tuple[bool, bool]:
    """Part 3 on a rank: (offloaded training equals in-memory training, host buffers pinned
    where the rank computes on a GPU)."""
    from .models import mse
    from .runtime import device
    from .sharded.offload import Offload
    from .sharded.offload_bench import batch, offload_model

    def trained(offload: str | None) -> tuple[torch.Tensor, Offload | None]:
        model, (x, y) = offload_model(48, 6, torch.float64, seed=3), batch(16, 48, torch.float64)
        adam = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
        off = None if offload is None else Offload(model, adam, offload, "host")
        if off is None:
            opt = adam(model.parameters())
            for _ in range(3):
                opt.zero_grad()
                mse(model(x), y).backward()
                opt.step()
        else:
            for _ in range(3):
                mse(off(x), y).backward()
                off.step()
            off.gather_parameters()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), off

    reference, _ = trained(None)
    swapped, off = trained("swap")
    equal = torch.allclose(swapped, reference, rtol=1e-12, atol=1e-14)
    pinned = all(layer.host.is_pinned() for layer in off.layers)
    return equal, pinned or device().type != "cuda"


def _offload_part(device: str) -> list[str]:
    equal, pinned = launch(_offload, 1, backend="gloo", device=device, timeout=300)[0]
    assert pinned, "the offloaded states' host copies are not pinned on a GPU run"
    assert equal, "offloaded training differs from training in memory"
    return ["states on the host (pinned on a GPU) and activations swapped on the copy "
            "stream: equal to training in memory"]


def _nccl_collectives() -> list[str]:
    """Part 4a on each rank: minipar's collectives against torch's own, under NCCL."""
    import torch.distributed as dist

    from . import collectives
    from .runtime import device, rank, world_size

    x = torch.arange(1 << 12, dtype=torch.float64, device=device()) * (rank() + 1)
    expected = x.clone()
    dist.all_reduce(expected)
    results = {a: collectives.all_reduce(x.clone(), algorithm=a)
               for a in collectives.ALL_REDUCE_ALGORITHMS}
    results["pipelined ring"] = collectives.pipelined_ring_all_reduce(x.clone())
    wrong = [a for a, got in results.items() if not torch.allclose(got, expected)]
    k = world_size()
    swapped = collectives.all_to_all(torch.full((k,), float(rank()), device=device()),
                                     send_counts=[1] * k, recv_counts=[1] * k)
    if swapped.tolist() != [float(r) for r in range(k)]:
        wrong.append("all_to_all")
    return wrong


def _nccl(gpus: int) -> list[str]:
    wrong = launch(_nccl_collectives, 2, backend="nccl", timeout=300)
    assert not any(wrong), f"under NCCL these differ from torch's: {wrong}"
    names = tuple(COMPOSITIONS) if gpus >= 4 else NCCL_COMPOSITIONS
    return ["collectives: every all-reduce algorithm and all_to_all equal torch's",
            *_compositions(names, "nccl", "cuda")]


def run_check(on_cpu: bool = False, out: Callable[[str], None] = print) -> bool:
    """Run every part this machine can; print each part's lines and PASS, FAIL or why it
    was skipped. True when nothing failed."""
    gpus = gpu_count()
    device, preset = ("cpu", "tiny") if on_cpu else ("cuda", "small")
    runs = (lambda: _one_rank(preset, device),
            lambda: _compositions(tuple(COMPOSITIONS), "gloo", device),
            lambda: _offload_part(device), lambda: _nccl(gpus))
    failed, started = False, time.perf_counter()
    for (name, needs), part in zip(PARTS, runs, strict=True):
        if on_cpu:  # CPU ranks stand in for one GPU: the parts needing more are skipped
            why = "--on-cpu" if needs > 1 else None
        else:
            why = _skipped(needs, gpus)
        if why is not None:
            out(f"{name}: skipped: {why}")
            continue
        try:
            lines = part()
        except Exception as err:  # one part's failure is reported; the others still run
            failed = True
            out(f"{name}: FAIL: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            continue
        out(f"{name}: PASS")
        for line in lines:
            out(f"    {line}")
    minutes = (time.perf_counter() - started) / 60
    out(f"gpu check: {'FAILED' if failed else 'passed'} in {minutes:.1f} min "
        f"({'CPU ranks, --on-cpu' if on_cpu else f'{gpus} GPU(s)'})")
    return not failed


def main(argv: list[str] | None = None, prog: str = "python -m minipar.gpu_check") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--on-cpu", action="store_true",
                        help="run parts 1-3 on CPU ranks with the tiny preset (tests the "
                             "check itself where there is no GPU)")
    args = parser.parse_args(argv)
    if not args.on_cpu and gpu_count() == 0:
        print("gpu check: skipped: torch sees no GPU here (a CPU-only build, or no driver); "
              "`--on-cpu` runs its parts on CPU ranks")
        return 0
    return run_command(prog, lambda: 0 if run_check(args.on_cpu) else 1)


if __name__ == "__main__":
    sys.exit(main())
