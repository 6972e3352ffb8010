"""The GPU check (issue 43): it skips in one line where there is no GPU, reports each
part's failure and goes on, and with --on-cpu runs its parts on CPU ranks, which tests
the check's own code here (CI has no GPU)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipar import gpu_check

pytestmark = pytest.mark.slow  # runs the whole GPU check on CPU ranks

ROOT = Path(__file__).resolve().parents[1]
PAGE_COMMANDS = [line for block in re.findall(r"```bash\n(.*?)```",
                                              (ROOT / "docs" / "gpus.md").read_text(), re.S)
                 for line in block.splitlines() if line.strip()]


def _run_page_command(line: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """A command as docs/gpus.md shows it, run with this interpreter from the checkout."""
    words = shlex.split(line)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if words[0].startswith("PYTHONPATH="):
        words = words[1:]
    assert words[0] in ("minipar", "python3"), line
    command = [sys.executable, *(["-m", "minipar"] if words[0] == "minipar" else []),
               *words[1:]]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: it would run")
def test_without_a_gpu_it_skips_in_one_line_and_exits_0():
    done = subprocess.run([sys.executable, "-m", "minipar.gpu_check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "gpu check: skipped: torch sees no GPU here (a CPU-only build, or no driver); "
        "`--on-cpu` runs its cases on CPU ranks"]


def test_doctor_says_which_parts_a_machine_runs():
    said = dict(gpu_check.parts_here(0))
    assert set(said.values()) == {"skipped: no GPU"} and list(said) == list(gpu_check.PARTS)
    one = dict(gpu_check.parts_here(1))
    assert one["1. one rank"] == "runs" and one["7. MFU and memory"] == "runs"
    assert one["2. point-to-point"] == "skipped: needs 2 GPUs or more"
    assert one["6. streams"] == "2 of 5 cases (the others need more GPUs)"
    assert set(dict(gpu_check.parts_here(8)).values()) == {"runs"}


def test_every_case_of_the_matrix_is_there_and_needs_its_ranks():
    matrix = {(c.part, c.name): c for c in gpu_check.cases(on_cpu=False, gpus=8)}
    p2p = [c for (part, _), c in matrix.items() if part == "2. point-to-point"]
    assert len(p2p) == 4 * 7 and {c.gpus for c in p2p} == {2, 3, 4, 8}
    composed = {name: c.gpus for (part, name), c in matrix.items() if part.startswith("4.")}
    assert composed["tp8 sp"] == 8 and composed["pp4 zb_v"] == 4
    assert composed["3D dp2 x tp2 x pp2"] == 8 and composed["resumed on another mesh"] == 4
    assert sum(name.startswith("pp") for name in composed) == 3 * 8 + 1


def _sleeps() -> None:
    import time

    time.sleep(30)


def test_a_failing_or_hanging_case_is_one_line_and_the_others_still_run(tmp_path):
    from minipar import launch

    def broken():
        raise AssertionError("dp2 differs from one process\nsecond line")

    def hangs():  # its own launch and timeout: the watchdog ends it, not the check
        launch(_sleeps, 2, backend="gloo", timeout=1)

    matrix = [gpu_check.CheckCase("1. one rank", "fine", 1, lambda: ["measured"]),
              gpu_check.CheckCase("1. one rank", "broken", 1, broken),
              gpu_check.CheckCase("2. point-to-point", "hangs", 2, hangs),
              gpu_check.CheckCase("2. point-to-point", "too big", 1, None, "--on-cpu: needs a GPU"),
              gpu_check.CheckCase("8. torchrun", "also fine", 1, lambda: [])]
    lines, report = [], tmp_path / "report.json"
    assert gpu_check.run_check(on_cpu=True, out=lines.append, report=report,
                               matrix=matrix) is False
    assert re.fullmatch(r"1\. one rank / fine: PASS \(\d+\.\d s\)", lines[0])
    assert lines[1] == "    measured"
    assert re.fullmatch(r"1\. one rank / broken: FAIL \(\d+\.\d s\): AssertionError: dp2 "
                        r"differs from one process", lines[2])
    assert lines[3].startswith("2. point-to-point / hangs: FAIL") and "RankTimeout" in lines[3]
    assert lines[4] == "2. point-to-point / too big: skipped: --on-cpu: needs a GPU"
    assert lines[5].startswith("8. torchrun / also fine: PASS")
    assert lines[6].startswith("gpu check: FAILED in ") and lines[6].endswith(
        "2 passed, 2 failed, 1 skipped")
    cases = json.loads(report.read_text())["cases"]
    assert [c["status"] for c in cases] == ["pass", "fail", "fail", "skip", "pass"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these commands really train")
@pytest.mark.parametrize("line", [c for c in PAGE_COMMANDS if "--on-cpu" not in c])
def test_every_command_on_the_gpu_page_runs_or_refuses_in_one_line(line, tmp_path):
    """Without a GPU, what needs one is refused in one line saying so; the rest runs."""
    done = _run_page_command(line, tmp_path)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-2000:]
    if "cuda" in line:
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done
        assert re.search(r"no GPU|on the CPU", done.stderr), done.stderr
    else:
        assert done.returncode == 0, done.stderr


@pytest.mark.slow  # every case of the GPU check that runs on CPU ranks
def test_on_cpu_ranks_every_case_that_can_run_passes(tmp_path):
    """The page's `minipar gpu-check --on-cpu`, as a learner would type it."""
    [line] = [c for c in PAGE_COMMANDS if "--on-cpu" in c]
    done = _run_page_command(line, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    statuses = {(c["part"], c["case"]): c["status"] for c in report["cases"]}
    assert "fail" not in statuses.values()
    assert statuses[("1. one rank", "smoke, NCCL")] == "skip"
    assert statuses[("2. point-to-point", "K=3 1F1B crossing")] == "pass"
    assert statuses[("3. collectives against torch's", "K=3")] == "pass"
    assert statuses[("5. one GPU shared by gloo ranks", "cp2")] == "pass"
    assert statuses[("8. torchrun", "torchrun --nproc-per-node 2")] == "pass"
    assert all(c["why"] for c in report["cases"] if c["status"] == "skip")
    lines = done.stdout.splitlines()
    assert sum(line.startswith("    largest gap to one process") for line in lines) == 5
    assert any(line.startswith("    bf16 vs fp32: largest relative loss gap") for line in lines)
