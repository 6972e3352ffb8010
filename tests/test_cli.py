"""The command line as a newcomer meets it: every mistake is one line on stderr with exit
status 2 (never a traceback), Ctrl-C is one line and leaves no rank behind, and
--version and doctor answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import process_gone

from minipar.runtime import gpu_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIPAR = [sys.executable, "-m", "minipar"]


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


MISTAKES = [
    (MINIPAR + ["bench", "collectives", "--out", "README.md"], "is a file"),
    (MINIPAR + ["bench", "nope"], "invalid choice: 'nope'"),
    (MINIPAR + ["bench", "train-dp", "--rounds", "0"], "--rounds: must be >= 1"),
    (MINIPAR + ["bench", "launch", "--rounds", "3"], "takes no rounds in turns"),
    (MINIPAR + ["lessons", "--student", "README.md"], "is a file"),
    (MINIPAR, "required"),
    ([sys.executable, "-m", "minipar.collectives", "--ranks", "0"], "--ranks: must be >= 1"),
    ([sys.executable, "-m", "minipar.collectives", "--ranks", "-1"], "--ranks: must be >= 1"),
    ([sys.executable, "-m", "minipar.pipeline", "--ranks", "two"], "expected a whole number"),
    ([sys.executable, "-m", "minipar.mesh", "--ranks", "4", "--dp", "3"], "dp"),
]


@pytest.mark.parametrize("args, says", MISTAKES, ids=lambda v: " ".join(v[2:]) if
                         isinstance(v, list) else None)
@pytest.mark.slow  # a fresh interpreter per mistake (imports torch each time)
def test_a_mistake_is_one_line_and_exit_status_2(args, says):
    done = _run(args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.skipif(gpu_count() >= 4, reason="this machine has the GPUs nccl needs")
def test_nccl_without_gpus_says_what_to_use_instead():
    done = _run([sys.executable, "-m", "minipar.collectives", "--backend", "nccl"])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "backend='gloo'" in line


def test_version_and_doctor():
    done = _run(MINIPAR + ["--version"])
    assert done.returncode == 0 and done.stdout.startswith("minipar ")
    done = _run(MINIPAR + ["doctor"])
    assert done.returncode == 0, done.stderr
    for what in ("torch", "backends", "CPU cores", "backend='auto'"):
        assert what in done.stdout
    # one core's rates in fp32, bf16 and fp16, and what each low precision means here
    rates = next(ln for ln in done.stdout.splitlines() if ln.startswith("matmuls "))
    assert "fp32 " in rates and "bf16 " in rates and "fp16 " in rates, rates
    for name in ("bf16", "fp16"):
        verdict = next(ln for ln in done.stdout.splitlines() if ln.startswith(name + " "))
        assert f"{name} matmuls run" in verdict and "on this CPU" in verdict, verdict
    assert ("CPU-only build" in done.stdout) == (not __import__("torch").version.cuda)


@pytest.mark.slow  # starts a command's ranks, interrupts them, waits for them to go
def test_ctrl_c_is_one_line_and_leaves_no_rank_behind():
    """Ctrl-C in a terminal interrupts the whole foreground group: the command and its
    ranks. The command says "interrupted", exits 130, and its ranks are gone."""
    command = subprocess.Popen([sys.executable, "-m", "minipar.mesh", "--ranks", "4"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    ranks: list[int] = []
    while time.monotonic() < deadline and len(ranks) < 4:  # wait until its ranks run
        time.sleep(0.3)
        ranks = _children(command.pid)
    os.killpg(command.pid, signal.SIGINT)
    out, err = command.communicate(timeout=60)
    assert command.returncode == 130, err
    assert err.strip().splitlines()[-1].endswith("interrupted") and "Traceback" not in err
    deadline = time.monotonic() + 15
    while not all(process_gone(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(process_gone(p) for p in ranks)


@pytest.mark.parametrize("after", [0.0, 1.2, 3.0])
@pytest.mark.slow  # three interrupted cold starts, up to 3 s in each
def test_ctrl_c_while_starting_is_one_line_too(after, tmp_path):
    """Before any rank runs (Python importing torch, runpy running the package's
    __main__, the forkserver importing torch too): still one line and 130, from the
    command alone. Each start is cold (an empty bytecode cache), where compiling every
    module widens each window.

    The clock starts when minipar's first module has run (-X importtime reports it on
    stderr), not when the process does: before that the interpreter runs site and the
    venv's .pth files (an editable install's finder imports pathlib; 0.2 s cold here),
    which no package can reach. Sleeping a fixed 0.3 s from the process's start once
    landed on a busy CI machine inside cli.py's `import signal`, before the handler was
    installed there (test_architecture checks it is now the package's first import)."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"))
    command = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "minipar.mesh", "--ranks", "2"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=env)
    lines: list[str] = []
    handler_in_place = threading.Event()

    def read_stderr():
        for line in command.stderr:
            lines.append(line)
            if line.split("|")[-1].strip() == "minipar.interrupt_at_start":
                handler_in_place.set()
        handler_in_place.set()  # the stream ended: let the assertions below say why

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert handler_in_place.wait(60) and command.poll() is None, "".join(lines)
        time.sleep(after)
        os.killpg(command.pid, signal.SIGINT)
        command.wait(timeout=60)
        reader.join(timeout=10)
    finally:  # never leave the command or its forkserver behind (their own session)
        try:
            os.killpg(command.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        command.wait(timeout=10)
    err = "".join(line for line in lines if "import time:" not in line)  # ranks' too
    assert command.returncode == 130, err
    assert err.strip().splitlines() == ["python -m minipar.mesh: interrupted"], err


def test_what_the_start_up_handler_imports_is_loaded_before_any_package_runs():
    """The handler's imports (test_architecture holds it to `_signal`, `os` and `sys`) cost
    nothing: a fresh interpreter has them loaded before running any code of ours."""
    loaded = subprocess.run([sys.executable, "-c", "import sys; print(sorted(m for m in "
                             "('_signal', 'os', 'sys') if m in sys.modules))"],
                            capture_output=True, text=True, timeout=60).stdout.split()
    assert loaded == ["['_signal',", "'os',", "'sys']"], loaded


def test_ctrl_c_while_a_rank_is_handed_its_start_is_held_until_it_has_it():
    """A rank reads its start-up data from the launcher through a pipe: a Ctrl-C that cut
    the launcher off halfway once left a rank printing "EOFError: Ran out of input" (a CI
    flake). The launcher holds it until the rank has its data, then raises it."""
    from minipar.runtime.group import _ctrl_c_held

    before = signal.getsignal(signal.SIGINT)
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with _ctrl_c_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs a signal's handler between bytecodes: here
            finished = True
    assert finished and signal.getsignal(signal.SIGINT) is before


def test_the_forkserver_and_its_ranks_never_see_ctrl_c(cluster2):
    """They start with SIGINT blocked (a mask inherited through exec and fork), while the
    launcher's own mask is as it was: an *ignored* SIGINT, as before, was ignored by the
    launcher too while the forkserver started, and a Ctrl-C there was lost (exit 0)."""
    import multiprocessing.forkserver as forkserver

    def sigint_blocked(pid: int | str) -> bool:
        with open(f"/proc/{pid}/status") as status:
            mask = next(line for line in status if line.startswith("SigBlk:"))
        return bool(int(mask.split()[1], 16) & (1 << (signal.SIGINT - 1)))

    assert sigint_blocked(forkserver._forkserver._forkserver_pid)
    assert cluster2.run(lambda: sigint_blocked("self")) == [True, True]
    assert not sigint_blocked("self")


def test_ctrl_c_after_runpy_took_argv_still_names_the_command():
    """The name is taken when the start-up handler is installed: once runpy has replaced
    sys.argv[0] ("-m") with the module's path, it can no longer be worked out (a cold
    start once printed "None: interrupted" there)."""
    script = ("import os, signal, sys\n"
              "sys.argv = ['-m', '--ranks', '2']\n"
              "sys.orig_argv = [sys.executable, '-m', 'minipar.mesh', '--ranks', '2']\n"
              "import minipar.cli\n"
              "sys.argv[0] = '/somewhere/minipar/mesh/__main__.py'  # what runpy does\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "import time; time.sleep(10)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == ["python -m minipar.mesh: interrupted"]


def _children(pid: int) -> list[int]:
    """Every process below `pid` (ranks and their forkserver), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Files a newcomer may hand the trainer or the lesson tools by mistake."""
    root = tmp_path_factory.mktemp("bad")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 8)  # NUL bytes: not text
    (root / "one.py").write_text("def f(): pass\n")
    (root / "two").mkdir()
    (root / "two" / "a.py").write_text("x = 1\n")
    (root / "two" / "b.py").write_text("y = 2\n")
    (root / "latin1.toml").write_bytes(b"[train]\nsteps = 5  # caf\xe9\n")
    for name, body in (("binary", b"\x00\xbd\x12"), ("json", b'{"cells": 3}')):
        (root / name).mkdir()
        (root / name / "00_lesson.ipynb").write_bytes(body)
    return root


TRAIN = ["train", "--steps", "2", "--warmup-steps", "0"]
BAD_INPUT = [
    (TRAIN + ["--data", "{root}/missing"], "does not exist"),
    (TRAIN + ["--data", "{root}/blob.bin"], "is not text"),
    (TRAIN + ["--data", "{root}/one.py"], "is one document"),
    (TRAIN + ["--data", "{root}/two"], "fewer than one sequence"),
    (["train", "--config", "{root}/latin1.toml"], "is not UTF-8 text"),
    (["train", "--config", "{root}/missing.toml"], "a .toml file that exists"),
    (["train", "--steps", "0"], "--steps: must be >= 1"),
    (["train", "--steps", "-3"], "--steps: must be >= 1"),
    (["train", "--fault", "boom@1:2"], "argument --fault: must be KIND@RANK:STEP"),
    (["train", "--fault", "kill@5:2"], "would never fire: the run has ranks 0..0"),
    (["lessons", "--student", "{root}/out", "--source", "{root}/missing"],
     "no lesson notebooks"),
    (["lessons", "--student", "{root}/out", "--source", "{root}/binary"],
     "is not a notebook"),
    (["lessons", "--html", "{root}/site", "--no-execute", "--source", "{root}/json"],
     "not a notebook (no list of cells)"),
    (["lessons", "--copy", "{root}/one.py"], "one.py is a file; name a folder"),
    (["tour", "--only", "basics,nope"], "--only nope is not a technique; choose from basics"),
]


@pytest.mark.parametrize("args, says", BAD_INPUT, ids=lambda v: " ".join(v[:3]) if
                         isinstance(v, list) else None)
def test_bad_input_is_one_line_and_exit_status_2(bad_inputs, capsys, args, says):
    """In this process (the command's own code path, without a Python start-up per case)."""
    from minipar.__main__ import main

    try:
        code = main([a.format(root=bad_inputs) for a in args])
    except SystemExit as exit_:  # argparse's own errors exit
        code = exit_.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], err


def test_lessons_copy_writes_the_course_and_keeps_an_instructors_edits(tmp_path, capsys):
    from minipar.__main__ import main

    assert main(["lessons", "--copy", str(tmp_path)]) == 0
    lessons = sorted(p.name for p in (tmp_path).glob("[0-9][0-9]_*.ipynb"))
    assert len(lessons) == 12 and (tmp_path / "sanitize.cfg").is_file()
    assert (tmp_path / "deep_dives" / "11b_race_against_torch.ipynb").is_file()
    first = tmp_path / "00_why_parallel.ipynb"
    assert "### BEGIN SOLUTION" in (tmp_path / "01_collectives.ipynb").read_text()  # whole
    first.write_text("{}")  # the instructor's own edits
    assert main(["lessons", "--copy", str(tmp_path)]) == 0
    assert first.read_text() == "{}" and "pass --force to overwrite" in capsys.readouterr().out
    assert main(["lessons", "--copy", str(tmp_path), "--force"]) == 0
    assert first.read_text() != "{}"


@pytest.mark.slow  # starts torchrun and its workers
def test_a_world_size_torchrun_disagrees_with_is_one_line_per_worker(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "minipar.train", "--dp", "4", "--steps", "2", "--warmup-steps", "0", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    ours = [line for line in done.stderr.splitlines() if line.startswith("python -m minipar")]
    # torchrun SIGTERMs the other workers as soon as one exits, so on a busy machine the
    # second may be stopped before it writes its line: one or two lines, each the advice
    assert 1 <= len(ours) <= 2 and all("torchrun started 2 processes" in line and "= 4" in line
                                       for line in ours), done.stderr[-3000:]
    assert "exitcode: 2" in done.stderr
    frames = [line for line in done.stderr.splitlines() if line.strip().startswith("File ")]
    assert not [f for f in frames if "minipar/train/" in f], done.stderr[-3000:]  # no traceback
