"""The elastic path: data parallelism under torchrun that survives a killed worker.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        -m minipar.slow_networks.elastic --dir CKPT --kill-at 1:5

On the first attempt rank 1 kills itself (SIGKILL) at step 5. torchrun's agent sees
the worker die, stops the others and starts every worker again; the new workers find
the checkpoint in CKPT (`checkpoint_restart.py`) and finish from there. Rank 0 prints the
steps it ran, checks the final parameters against one process and writes them to
CKPT/final.pt. Without torchrun it spawns --ranks ranks and runs once (nothing would
restart a killed rank, so no --kill-at).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ..cli import positive_int, run_command
from ..data_parallel import single_process_sgd
from ..demo import check_torchrun_ranks, demo_parser
from ..models import mlp, mse, regression_data
from ..runtime import launch, rank, under_torchrun
from .checkpoint_restart import train_resumable

BATCH, FEATURES = 20, 8  # 20 rows: 5 per rank on 4, uneven on 3


def model() -> torch.nn.Module:
    """The small regression MLP the fault-tolerance and network-lab runs train (float64)."""
    return mlp([FEATURES, 16, 1], seed=0, dtype=torch.float64)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of the regression task."""
    x, y = regression_data(steps * BATCH, FEATURES, seed=1, dtype=torch.float64)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def main(argv: list[str] | None = None) -> int:
    """Parse the options, train (resuming from --dir), and on rank 0 print the steps this
    attempt ran and whether the final parameters match one process."""
    prog = "python -m minipar.slow_networks.elastic"
    parser = demo_parser(
        "Data-parallel SGD with momentum that checkpoints every few steps and resumes from "
        "the latest checkpoint, its final weights checked against one process. Under "
        "torchrun --max-restarts, a worker killed with --kill-at is restarted and resumes; "
        "without torchrun it spawns --ranks ranks and runs once.", default_ranks=2, prog=prog)
    parser.add_argument("--dir", default=None,
                        help="checkpoint folder, kept across restarts (default: a temporary "
                             "folder, removed at the end; needed under torchrun)")
    parser.add_argument("--steps", type=positive_int, default=8, help="training steps in all "
                                                                      "(default 8)")
    parser.add_argument("--every", type=positive_int, default=2,
                        help="steps between checkpoints (default 2)")
    parser.add_argument("--kill-at", default=None, metavar="RANK:STEP",
                        help="under torchrun, on the first attempt only, RANK kills itself at "
                             "STEP")
    args = parser.parse_args(argv)
    check_torchrun_ranks(parser, args.ranks)
    if under_torchrun() and args.dir is None:
        parser.error("under torchrun, --dir must name a folder the restarted workers find")
    if args.kill_at and not under_torchrun():
        parser.error("--kill-at needs torchrun --max-restarts to restart the killed rank")
    kill = None
    # torchrun sets TORCHELASTIC_RESTART_COUNT, 0 on the first attempt: a restarted worker must
    # not kill itself again, or the run would never finish
    if args.kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        victim, step = (int(v) for v in args.kill_at.split(":"))
        kill = (victim, step)
    with tempfile.TemporaryDirectory(prefix="minipar-elastic-") as scratch:
        folder = args.dir or scratch
        return run_command(prog, lambda: _train(args, folder, kill))


def _train(args, folder: str, kill: tuple[int, int] | None) -> int:
    results = launch(train_resumable, args.ranks, model, batches(args.steps), mse, 0.05,
                     folder, args.every, kill_at=kill, backend=args.backend,
                     timeout=args.timeout)
    losses, params = results[0]
    _, reference = single_process_sgd(model(), batches(args.steps), mse, 0.05, momentum=0.9)
    # float64 on both sides and tight tolerances: only summation order may differ
    same = bool(torch.allclose(params, reference, rtol=1e-10, atol=1e-12))
    if rank() == 0:
        torch.save(params, Path(folder) / "final.pt")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        last = f"final loss {losses[-1]:.4f}" if losses else "nothing left to run"
        print(f"attempt {int(restart) + 1}: ran {len(losses)} steps on {args.ranks} ranks, "
              f"{last}", flush=True)
        print(f"final weights match one process (SGD with momentum, whole batches): "
              f"{'yes' if same else 'NO'}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
