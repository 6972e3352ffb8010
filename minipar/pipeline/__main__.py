"""python -m minipar.pipeline --ranks 2, or under torchrun: every synchronous schedule on
real ranks, checked against one process."""

from __future__ import annotations

import torch

from ..runtime import demo_parser, launch, rank, world_size
from .engine import Pipeline, split_model
from .schedules import schedule

CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("zb_h1", 4, 1), ("interleaved_1f1b", 4, 2),
         ("looped_bfs", 4, 2)]


def _layers(stages: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16, dtype=torch.float64),
                                                     torch.nn.Tanh()) for _ in range(stages)])


def _batch() -> torch.Tensor:
    return torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _run() -> list[tuple[str, bool]]:
    k, report = world_size(), []
    for name, m, v in CASES:
        if m % k and name == "interleaved_1f1b":
            continue
        pipe = Pipeline(split_model(_layers(k * v), k * v), schedule(name, k, m, v))
        pipe.train_step(_batch(), torch.zeros(8, 16, dtype=torch.float64),
                        lambda o, t: (o ** 2).mean())
        reference = split_model(_layers(k * v), k * v)
        (torch.nn.Sequential(*reference)(_batch()) ** 2).mean().backward()
        same = all(torch.allclose(p.grad, q.grad, rtol=1e-10)
                   for s, mod in pipe.modules.items()
                   for p, q in zip(mod.parameters(), reference[s].parameters(), strict=True))
        report.append((name, same))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = demo_parser(__doc__.splitlines()[0], 2)
    args = parser.parse_args(argv)
    results = launch(_run, args.ranks, backend=args.backend)
    if rank() == 0:
        for r, report in enumerate(results):
            for name, same in report:
                print(f"rank {r}: {name:17} gradients equal one process: {same}")


if __name__ == "__main__":
    main()
