"""The `minipar` command: tour, bench, lessons."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _default_lessons() -> Path:
    return Path(__file__).resolve().parent.parent / "lessons"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minipar", description="Parallel training, run for real.")
    commands = parser.add_subparsers(dest="command", required=True)

    tour = commands.add_parser("tour", help="run every technique on CPU ranks and report")
    tour.add_argument("--out", default="minipar-out", help="folder for pictures and traces")

    bench = commands.add_parser("bench", help="run a benchmark: table, JSON and plot")
    from .bench import BENCHMARKS

    bench.add_argument("name", choices=list(BENCHMARKS), metavar="name",
                       help=f"which benchmark ({', '.join(BENCHMARKS)})")
    bench.add_argument("--out", default="bench-out", help="folder for JSON and plot")

    lessons = commands.add_parser("lessons", help="write learners' copies of the lessons")
    lessons.add_argument("--student", required=True, metavar="DIR",
                         help="folder for the copies, solutions replaced by stubs")
    lessons.add_argument("--source", default=None, help="lessons folder (default: the checkout's)")

    args = parser.parse_args(argv)
    try:
        if args.command == "tour":
            from .tour import run_tour

            rows = run_tour(args.out)
            return 0 if all(r.matches is not False for r in rows) else 1
        if args.command == "bench":
            from .bench import run_benchmark

            run_benchmark(args.name, args.out)
            return 0
        from .lessons import write_student_copies

        written = write_student_copies(args.source or _default_lessons(), args.student)
        for path in written:
            print(f"wrote {path}")
        return 0
    except ValueError as err:
        print(f"minipar {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
