"""The GPU check's trainer cases, each run on the launcher's side in launches of its own:
a one-rank smoke test, compositions equal to one process, the offload copy stream, and
MFU and memory on a mid-size bf16 model.

A composition trains the `tiny` preset in float64 on its mesh and on one process on the
same device; the loss curves must agree within compare.py's fixed bound (1e-10), as CI
holds them on CPU ranks. The bf16 case compares with one bf16 process under a loose
bound, since bf16 reorders its rounding with the layout.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import torch

from ..runtime import launch

MIB = 2**20
BF16_BOUND = 0.05  # largest |bf16 - fp32| / fp32 loss, at any step
STEPS = {"small": 200, "tiny": 8}
SCHEDULE_VIRTUAL = {"interleaved_1f1b": 2, "looped_bfs": 2, "zb_v": 2, "dualpipev": 2}
# the mid-size model of the MFU case: about 12 layers x 2048, the size nanoGPT-scale
# trainers report MFU for
MID_SIZE = {"model.layers": 12, "model.hidden": 2048, "model.heads": 16, "model.kv_heads": 16,
            "model.seq_len": 1024, "model.ffn_hidden": 5632, "train.batch_size": 8}


def config(preset: str, **overrides):
    from ..train.config import load_config

    steps = overrides.pop("train.steps", STEPS[preset])
    return load_config(preset, {"train.steps": steps, "train.eval_every": 0,
                                "optim.warmup_steps": min(50, steps // 4), **overrides})


def smoke(backend: str, device: str) -> list[str]:
    """One rank trains `tiny` for a few steps under `backend` on `device`."""
    from ..train.loop import train

    run = launch(train, 1, config("tiny", **{"train.steps": 4}), backend=backend,
                 device=device, timeout=300)[0]
    assert all(l == l for l in run.losses), f"a loss is NaN: {run.losses}"  # noqa: E741
    return [f"4 steps of tiny, loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}"]


def fp32_and_bf16(preset: str, device: str) -> list[str]:
    """fp32 and bf16 on one rank: tokens/s, MFU at most 1, the allocator's peak holding
    the model's states, and bf16's loss within BF16_BOUND of fp32's at every step."""
    from ..train.loop import train

    lines, losses = [], {}
    for precision in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as out:
            run = launch(train, 1, config(preset, **{"train.precision": precision}), out,
                         backend="gloo", device=device, timeout=600)[0]
        losses[precision] = run.losses
        lines += _measured(run, precision)
    gap = max(abs(b - f) / f for f, b in zip(losses["fp32"], losses["bf16"], strict=True))
    lines.append(f"bf16 vs fp32: largest relative loss gap {gap:.2%} over "
                 f"{len(losses['fp32'])} steps (bound {BF16_BOUND:.0%})")
    assert gap <= BF16_BOUND, f"bf16's loss left fp32's by {gap:.2%}, more than {BF16_BOUND:.0%}"
    return lines


def _measured(run, precision: str) -> list[str]:
    steady = run.records[len(run.records) // 4:]  # past the first steps' warm-up
    tokens = sum(r["tokens_per_s"] for r in steady) / len(steady)
    mfu = max(r["mfu"] for r in run.records)
    mem = run.memory
    states = sum(mem["measured"][k] for k in ("parameters", "gradients", "optimizer"))
    allocator = mem.get("allocator_peak")
    assert 0 < mfu <= 1, f"{precision}: MFU {mfu:.2f} is above 1: the peak is wrong"
    assert allocator is None or allocator >= states, \
        f"{precision}: the GPU's allocator held {allocator} bytes, less than the weights, " \
        f"gradients and Adam's state ({states}): the model is not on the GPU"
    return [f"{precision}: {tokens:,.0f} tokens/s, MFU {mfu:.1%} at most",
            f"  {run.peak.describe()}",
            f"  memory MiB: tracker {sum(mem['measured'].values()) / MIB:.1f}, planner "
            f"{sum(mem['predicted'].values()) / MIB:.1f}, allocator peak "
            + ("none on a CPU" if allocator is None else f"{allocator / MIB:.1f}")]


def mid_size_mfu() -> list[str]:
    """bf16 on the mid-size model: the timed matmul at 70% or more of the card's data
    sheet (where the card is known), MFU at most 1, the allocator holding the states."""
    from ..train.loop import train

    run = launch(train, 1, config("small", **{"train.precision": "bf16", "train.steps": 30,
                                              **MID_SIZE}),
                 backend="gloo", device="cuda", timeout=900)[0]
    lines = _measured(run, "bf16, 12 layers x 2048")
    peak = run.peak
    if peak.datasheet is not None:
        share = peak.measured / peak.datasheet
        lines.append(f"the timed bf16 matmul reaches {share:.0%} of the data sheet")
        assert share >= 0.7, f"the timed matmul reaches only {share:.0%} of the data sheet"
    return lines


def compositions() -> dict[str, dict]:
    """name -> (parallel, model, train) overrides of the compositions held to one process."""
    from ..train.loop import SYNCHRONOUS

    cases: dict[str, dict] = {
        "dp2": {"parallel.dp": 2}, "dp2, untied head": {"parallel.dp": 2, "model.tied": False},
        "zero1": {"parallel.dp": 2, "parallel.zero": 1},
        "zero2": {"parallel.dp": 2, "parallel.zero": 2},
        "zero3": {"parallel.dp": 2, "parallel.zero": 3},
        "hsdp": {"parallel.dp": 4, "parallel.zero": 3, "parallel.dp_replicate": 2},
        "ep2": {"parallel.dp": 2, "parallel.ep": 2, "model.experts": 2},
        "cp2 ring": {"parallel.cp": 2}, "cp2 ulysses": {"parallel.cp": 2,
                                                        "parallel.cp_kind": "ulysses"},
        "3D dp2 x tp2 x pp2": {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2,
                               "parallel.microbatches": 2}}
    for tp in (2, 4, 8):
        # tp divides the heads and the key/value heads: tiny has 4 and 2, so 8 and 8 here
        heads = {"model.heads": 8, "model.kv_heads": 8} if tp > 2 else {}
        cases[f"tp{tp}"] = {"parallel.tp": tp, **heads}
        cases[f"tp{tp} sp"] = {"parallel.tp": tp, "parallel.sequence_parallel": True, **heads}
    for pp in (2, 4, 8):
        for schedule in SYNCHRONOUS:
            virtual = SCHEDULE_VIRTUAL.get(schedule, 1)
            cases[f"pp{pp} {schedule}"] = {
                "parallel.pp": pp, "parallel.schedule": schedule, "parallel.virtual": virtual,
                "parallel.microbatches": pp, "model.layers": pp * virtual}
    # messages of 16 MiB and more: 16 sequences x 256 positions x 512 wide x 8 bytes
    cases["pp2 1f1b, 16 MiB messages"] = {
        "parallel.pp": 2, "parallel.microbatches": 2, "model.hidden": 512,
        "model.seq_len": 256, "train.batch_size": 32}
    return cases


def held_to_one_process(overrides: dict, backend: str, device: str) -> list[str]:
    """The composition `overrides` of `tiny` in fp64 against one process on `device`."""
    from ..train.compare import FIXED_TOLERANCES, compare_losses, ranks_of
    from ..train.loop import train

    layout = {k: v for k, v in overrides.items() if k.startswith("parallel.")}
    shape = {k: v for k, v in overrides.items() if not k.startswith("parallel.")}
    base = config("tiny", **{"train.precision": "fp64", **shape})
    one = launch(train, 1, base, backend="gloo", device=device, timeout=600)[0].losses
    mesh = config("tiny", **{"train.precision": "fp64", **overrides})
    runs = launch(train, ranks_of(mesh), mesh, backend=backend, device=device, timeout=600)
    gap = compare_losses(next(r for r in runs if r.records).losses, one)
    bound = FIXED_TOLERANCES["fp64"]
    assert gap.largest <= bound, f"{layout} differs from one process by {gap.largest:.1e}"
    return [f"largest gap to one process {gap.largest:.1e} (bound {bound:.0e})"]


def bf16_dp2(backend: str, device: str) -> list[str]:
    """dp2 in bf16 against one bf16 process: bf16 rounds differently with the layout, so
    the bound is loose (BF16_BOUND, relative)."""
    from ..train.loop import train

    base = config("tiny", **{"train.precision": "bf16"})
    one = launch(train, 1, base, backend="gloo", device=device, timeout=600)[0].losses
    dp2 = launch(train, 2, replace(base, parallel=replace(base.parallel, dp=2)),
                 backend=backend, device=device, timeout=600)[0].losses
    gap = max(abs(a - b) / b for a, b in zip(dp2, one, strict=True))
    assert gap <= BF16_BOUND, f"bf16 dp2 left one process by {gap:.2%}"
    return [f"largest relative gap to one bf16 process {gap:.2%} (bound {BF16_BOUND:.0%})"]


def resumed_on_another_mesh(backend: str, device: str) -> list[str]:
    """Stopped at step 2 of 4 on dp2 x tp2, resumed on pp2: the curve one process draws."""
    from ..train.compare import FIXED_TOLERANCES, compare_losses
    from ..train.loop import train

    settings = {"train.precision": "fp64", "train.steps": 4, "train.checkpoint_every": 2}
    one = launch(train, 1, config("tiny", **settings), backend="gloo", device=device,
                 timeout=600)[0].losses
    first = config("tiny", **settings, **{"parallel.dp": 2, "parallel.tp": 2})
    then = config("tiny", **settings, **{"parallel.pp": 2, "parallel.microbatches": 2})
    with tempfile.TemporaryDirectory() as out:
        launch(train, 4, first, out, False, False, 2, backend=backend, device=device,
               timeout=600)
        runs = launch(train, 2, then, out, False, True, backend=backend, device=device,
                      timeout=600)
    gap = compare_losses(next(r for r in runs if r.records).losses, one[2:])
    assert gap.largest <= FIXED_TOLERANCES["fp64"], f"the resumed run differs by {gap.largest}"
    return [f"dp2 x tp2 -> pp2 at step 2: largest gap to one process {gap.largest:.1e}"]


def _offload_on_rank(width: int, layers: int) -> tuple[bool, bool]:
    """(offloaded training equals in-memory training, host buffers pinned where the rank
    computes on a GPU)."""
    from ..models import mse
    from ..runtime import device
    from ..sharded.offload import Offload
    from ..sharded.offload_bench import batch, offload_model

    def trained(offload: str | None) -> tuple[torch.Tensor, Offload | None]:
        model = offload_model(width, layers, torch.float64, seed=3)
        x, y = batch(16, width, torch.float64)
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


def offload(device: str, width: int = 48) -> list[str]:
    """States on the host, activations swapped on the copy stream: equal to training in
    memory; at a large width the copies are long enough to lose a race if unordered."""
    equal, pinned = launch(_offload_on_rank, 1, width, 6, backend="gloo", device=device,
                           timeout=600)[0]
    assert pinned, "the offloaded states' host copies are not pinned on a GPU run"
    assert equal, "offloaded training differs from training in memory"
    return [f"width {width}: states on the host (pinned on a GPU) and activations swapped "
            "on the copy stream, equal to training in memory"]
