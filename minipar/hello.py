"""Hello, ranks: every rank says hello and they agree on a sum with one all-reduce.

    python -m minipar.hello --ranks 4                  # spawns 4 CPU ranks
    torchrun --nproc-per-node 2 -m minipar.hello       # joins torchrun's ranks
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import minipar


def hello() -> float:
    """Each rank contributes rank+1; after all_reduce every rank holds 1+2+...+K."""
    me, size = minipar.rank(), minipar.world_size()
    value = torch.tensor([me + 1.0], device=minipar.device())
    dist.all_reduce(value)
    print(f"hello from rank {me} of {size} on {minipar.device()}: sum = {value.item():g}")
    return value.item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=int(os.environ.get("WORLD_SIZE", 4)))
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args(argv)
    results = minipar.launch(hello, args.ranks, backend=args.backend)
    expected = args.ranks * (args.ranks + 1) / 2
    if minipar.rank() == 0:
        ok = all(r == expected for r in results)
        print(f"all {args.ranks} ranks agree on {expected:g}: {ok}")


if __name__ == "__main__":
    main()
