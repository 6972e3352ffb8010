"""The GPU check (issue 43): it skips in one line where there is no GPU, reports each
part's failure and goes on, and with --on-cpu runs its parts on CPU ranks, which tests
the check's own code here (CI has no GPU)."""

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
        "`--on-cpu` runs its parts on CPU ranks"]


def test_doctor_says_which_parts_a_machine_runs():
    assert [what for _, what in gpu_check.parts_here(0)] == ["skipped: no GPU"] * 3 + [
        "skipped: needs 2 GPUs, 0 here"]
    assert [what for _, what in gpu_check.parts_here(1)][:3] == ["runs"] * 3
    assert [what for _, what in gpu_check.parts_here(2)] == ["runs"] * 4


def test_a_failing_part_is_one_line_and_the_others_still_run(monkeypatch):
    def broken(*args):
        raise AssertionError("dp2 differs from one process\nsecond line")

    monkeypatch.setattr(gpu_check, "_one_rank", lambda *a: ["fine"])
    monkeypatch.setattr(gpu_check, "_compositions", broken)
    monkeypatch.setattr(gpu_check, "_offload_part", lambda *a: ["also fine"])
    lines = []
    assert gpu_check.run_check(on_cpu=True, out=lines.append) is False
    assert lines[:6] == [
        "1. one GPU, one rank: PASS", "    fine",
        "2. one GPU, ranks over gloo: FAIL: AssertionError: dp2 differs from one process",
        "3. the offload copy stream: PASS", "    also fine",
        "4. NCCL over 2+ GPUs: skipped: --on-cpu"]
    assert lines[6].startswith("gpu check: FAILED in ")


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


@pytest.mark.slow  # every part of the GPU check, on CPU ranks
def test_on_cpu_ranks_every_part_but_nccl_passes(tmp_path):
    """The page's `minipar gpu-check --on-cpu`, as a learner would type it."""
    [line] = [c for c in PAGE_COMMANDS if "--on-cpu" in c]
    done = _run_page_command(line, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if not line.startswith("[rank")]
    heads = [line for line in lines if not line.startswith(" ")]
    assert heads[:4] == ["1. one GPU, one rank: PASS", "2. one GPU, ranks over gloo: PASS",
                         "3. the offload copy stream: PASS",
                         "4. NCCL over 2+ GPUs: skipped: --on-cpu"]
    assert sum(": largest gap to one process" in line for line in lines) == 5
    assert any(line.startswith("    bf16 vs fp32: largest relative loss gap") for line in lines)
