"""Running the GPU check's matrix: each case alone, timed, its failure one line; a table
at the end and a JSON report of every case."""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cli import run_command
from ..runtime import gpu_count, machine_line
from ..runtime.device import gpu_facts
from .cases import PARTS, CheckCase, cases


@dataclass
class CaseResult:
    part: str
    case: str
    status: str  # "pass", "fail" or "skip"
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    why: str = ""  # a failure's one line, or why the case was skipped


def _skip_reason(case: CheckCase, gpus: int, on_cpu: bool) -> str | None:
    if case.run is None:
        return case.why
    if not on_cpu and case.gpus > gpus:
        return f"needs {case.gpus} GPUs, {gpus} here"
    return None


def parts_here(gpus: int | None = None) -> list[tuple[str, str]]:
    """(part, what this machine runs of it): what `minipar doctor` prints."""
    gpus = gpu_count() if gpus is None else gpus
    matrix = cases(on_cpu=False, gpus=gpus)
    said = []
    for part in PARTS:
        mine = [c for c in matrix if c.part == part]
        runs = sum(gpus > 0 and _skip_reason(c, gpus, False) is None for c in mine)
        fewest = min(c.gpus for c in mine)
        said.append((part, "runs" if runs == len(mine) else
                     "skipped: no GPU" if gpus == 0 else
                     f"skipped: needs {fewest} GPUs or more" if runs == 0 else
                     f"{runs} of {len(mine)} cases (the others need more GPUs)"))
    return said


def run_case(case: CheckCase, gpus: int, on_cpu: bool) -> CaseResult:
    why = _skip_reason(case, gpus, on_cpu)
    if why is not None:
        return CaseResult(case.part, case.name, "skip", why=why)
    started = time.perf_counter()
    try:
        lines = case.run()
        status, why = "pass", ""
    except Exception as err:  # one case's failure is one line; the others still run
        lines, status = [], "fail"
        first = (str(err).strip().splitlines() or [""])[0]
        why = f"{type(err).__name__}: {first[:300]}"
    return CaseResult(case.part, case.name, status, time.perf_counter() - started, lines, why)


def run_check(on_cpu: bool = False, out: Callable[[str], None] = print,
              report: Path | None = None, only: str | None = None,
              matrix: list[CheckCase] | None = None) -> bool:
    """Run every case this machine can (those whose name or part contains `only`), one
    at a time; print each, then the table, and write the JSON `report`. True when none
    failed."""
    gpus = gpu_count()
    matrix = cases(on_cpu, gpus) if matrix is None else matrix
    if only is not None:
        matrix = [c for c in matrix if only in c.name or only in c.part]
    started, outcomes = time.perf_counter(), []
    for case in matrix:
        outcome = run_case(case, gpus, on_cpu)
        outcomes.append(outcome)
        head = f"{case.part} / {case.name}:"
        if outcome.status == "skip":
            out(f"{head} skipped: {outcome.why}")
        elif outcome.status == "fail":
            out(f"{head} FAIL ({outcome.seconds:.1f} s): {outcome.why}")
        else:
            out(f"{head} PASS ({outcome.seconds:.1f} s)")
            for line in outcome.lines:
                out(f"    {line}")
    minutes = (time.perf_counter() - started) / 60
    failed = [o for o in outcomes if o.status == "fail"]
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skip")}
    out(f"gpu check: {'FAILED' if failed else 'passed'} in {minutes:.1f} min "
        f"({'CPU ranks, --on-cpu' if on_cpu else f'{gpus} GPU(s)'}): {counts['pass']} "
        f"passed, {counts['fail']} failed, {counts['skip']} skipped")
    for part in PARTS:
        mine = [o for o in outcomes if o.part == part]
        if mine:
            out(f"  {part:<34} " + "  ".join(
                f"{sum(o.status == s for o in mine):3d} {s}" for s in ("pass", "fail", "skip"))
                + f"  {sum(o.seconds for o in mine):7.1f} s")
    if report is not None:
        report.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": machine_line(),
            **gpu_facts(), "on_cpu": on_cpu, "minutes": minutes,
            "cases": [asdict(o) for o in outcomes]}, indent=1) + "\n")
        out(f"report: {report}")
    return not failed


DESCRIPTION = ("The GPU check: what minipar claims about GPUs, run on the GPUs there are, as "
               "a matrix of cases, each in launches of its own")


def main(argv: list[str] | None = None, prog: str = "python -m minipar.gpu_check") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--on-cpu", action="store_true",
                        help="run what can run on CPU ranks, with gloo and small sizes "
                             "(tests the check itself where there is no GPU)")
    parser.add_argument("--report", type=Path, default=Path("gpu-check.json"),
                        help="where to write the JSON report (default gpu-check.json)")
    parser.add_argument("--only", default=None,
                        help="only the cases whose name or part contains this")
    args = parser.parse_args(argv)
    if not args.on_cpu and gpu_count() == 0:
        print("gpu check: skipped: torch sees no GPU here (a CPU-only build, or no driver); "
              "`--on-cpu` runs its cases on CPU ranks")
        return 0
    return run_command(prog, lambda: 0 if run_check(args.on_cpu, report=args.report,
                                                   only=args.only) else 1)
