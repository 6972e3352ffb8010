"""The `minipar` command: tour, bench, lessons, grade, train, gpu-check, doctor."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .cli import OneLineParser, output_folder, positive_int, run_command


def _default_lessons() -> Path:
    """This checkout's lessons/, or, in an installed wheel, the copy it carries."""
    checkout = Path(__file__).resolve().parent.parent / "lessons"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "course"


def _parser() -> OneLineParser:
    from . import __version__
    from .bench import BENCHMARKS

    parser = OneLineParser(
        prog="minipar",
        description="Parallel training, built small and run for real: every technique on "
                    "CPU processes or GPUs, checked against one process.")
    parser.add_argument("--version", action="version", version=f"minipar {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command",
                                     parser_class=OneLineParser)
    tour = commands.add_parser(
        "tour", help="run every technique on CPU ranks, check it against one process, report",
        description="Run every technique on CPU ranks, check each against one process, and "
                    "write a report, pictures and Chrome traces.")
    tour.add_argument("--out", default="minipar-out", type=output_folder,
                      help="folder for the report, pictures and traces (default: minipar-out)")
    tour.add_argument("--only", default=None, metavar="NAMES",
                      help="comma-separated techniques to run, e.g. basics,collectives "
                           "(default: all)")
    bench = commands.add_parser(
        "bench", help="run a benchmark: table, JSON and plot",
        description="Run one benchmark: print its table, write its JSON and plot.")
    bench.add_argument("name", choices=list(BENCHMARKS), metavar="name",
                       help=f"which benchmark: {', '.join(BENCHMARKS)}")
    bench.add_argument("--out", default="bench-out", type=output_folder,
                       help="folder for the JSON and the plot (default: bench-out)")
    bench.add_argument("--rounds", type=positive_int, default=None, metavar="N",
                       help="rounds in turns, for the benchmarks that take turns (default: "
                            "each one's own; more rounds, a steadier median)")
    lessons = commands.add_parser(
        "lessons", help="learners' copies of the lessons, or the lessons as an offline site",
        description="--copy DIR: write the lessons and deep dives as they ship (solutions, "
                    "outputs, the files they read), to teach from or run. --student DIR: write "
                    "learners' copies of the lesson notebooks (every "
                    "solution replaced by a stub naming its exercise, outputs and saved widget "
                    "state cleared; notebooks already in DIR are kept unless --force). "
                    "--html DIR: run every lesson and write it as an HTML page with its "
                    "widgets, plus index.html; every script is in DIR, so the site works "
                    "offline (npm is needed once, to fetch the widget manager).")
    target = lessons.add_mutually_exclusive_group(required=True)
    target.add_argument("--copy", metavar="DIR",
                        help="folder for the instructor's copies: solutions and outputs kept")
    target.add_argument("--student", metavar="DIR", help="folder for the learners' copies")
    target.add_argument("--html", metavar="DIR", help="folder for the offline site")
    lessons.add_argument("--no-execute", action="store_true",
                         help="with --html: use the outputs saved in the notebooks instead "
                              "of running them (seconds instead of minutes)")
    lessons.add_argument("--source", default=None, metavar="DIR",
                         help="lessons folder (default: this checkout's lessons/, or the "
                              "copy an installed wheel carries)")
    lessons.add_argument("--force", action="store_true",
                         help="overwrite notebooks already in DIR (your work in them is lost)")
    grade = commands.add_parser(
        "grade", help="grade a class: run every learner's notebook of a lesson, write "
                      "gradebook.csv",
        description="Execute each submitted notebook of one lesson (NAME.ipynb or "
                    "NAME/.../NN_*.ipynb) alone, with a time limit, and record each exercise "
                    "check: pass, or the hint it gave. Writes gradebook.csv and prints a "
                    "summary; a notebook that hangs, crashes or is broken is one line.")
    grade.add_argument("submissions", help="folder of submitted notebooks")
    grade.add_argument("--lesson", required=True, type=_two_digits, metavar="NN",
                       help="the lesson's number, e.g. 01")
    grade.add_argument("--limit", type=float, default=600, metavar="SECONDS",
                       help="time limit per notebook (default 600)")
    grade.add_argument("--out", default=None, metavar="DIR",
                       help="folder for gradebook.csv (default: the submissions folder)")
    grade.add_argument("--source", default=None, metavar="DIR",
                       help="lessons folder whose checks are graded (default: this "
                            "checkout's lessons/, or the copy an installed wheel carries)")
    commands.add_parser(
        "train", add_help=False,
        help="train a decoder on real text, every technique composed (minipar train --help); "
             "minipar train compare: configurations' loss curves vs one process",
        description="Train the trainer's decoder: see `minipar train --help` and `minipar "
                    "train compare --help`.")
    commands.add_parser(
        "gpu-check", add_help=False,
        help="run what minipar claims about GPUs on the GPUs there are (skips without one)",
        description="See `minipar gpu-check --help`.")
    commands.add_parser(
        "doctor", help="what this machine gives minipar: torch build, backends, cores",
        description="Print, on one screen, the torch build (CPU or CUDA), the backends, GPUs "
                    "and cores, what backend='auto' picks, and the extras the lessons need.")
    return parser


def _two_digits(text: str) -> str:
    if not re.fullmatch(r"\d{1,2}", text):
        raise argparse.ArgumentTypeError(f"expected a lesson number such as 01; got {text!r}")
    return text.zfill(2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # its own flags (a config's every field): its own parser
        from .train.__main__ import main as train_main

        return train_main(argv[1:], prog="minipar train")
    if argv[:1] == ["gpu-check"]:
        from .gpu_check import main as gpu_check_main

        return gpu_check_main(argv[1:], prog="minipar gpu-check")
    args = _parser().parse_args(argv)
    return run_command(f"minipar {args.command}", lambda: _run(args))


def _run(args) -> int:
    if args.command == "tour":
        from .tour import run_tour

        rows = run_tour(args.out, args.only.split(",") if args.only else None)
        return 0 if all(r.matches is not False for r in rows) else 1
    if args.command == "bench":
        from .bench import run_benchmark

        run_benchmark(args.name, args.out, args.rounds)
        return 0
    if args.command == "grade":
        from .gradebook import grade_class, summary

        checks, grades = grade_class(args.submissions, args.lesson,
                                     args.source or _default_lessons(), args.limit, args.out)
        print(summary(checks, grades))
        print(f"wrote {Path(args.out or args.submissions) / 'gradebook.csv'}")
        return 0
    if args.command == "doctor":
        from .doctor import print_report

        print_report()
        return 0
    if args.html:
        from .lesson_site import build_site

        try:
            pages = build_site(args.source or _default_lessons(), args.html,
                               execute=not args.no_execute)
        except RuntimeError as err:  # npm missing or the registry unreachable: say so
            print(f"minipar lessons: {err}", file=sys.stderr)
            return 1
        print(f"wrote {len(pages)} lessons and deep dives and index.html to {args.html}; open "
              f"{Path(args.html) / 'index.html'} in a browser")
        return 0
    from .lessons import write_instructor_copies, write_student_copies

    write = write_instructor_copies if args.copy else write_student_copies
    dest = args.copy or args.student
    written, kept = write(args.source or _default_lessons(), dest, force=args.force)
    for path in written:
        print(f"wrote {path}")
    if kept:
        print(f"kept {len(kept)} notebook(s) already in {dest} (your work): "
              f"{', '.join(p.name for p in kept)}; pass --force to overwrite them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
