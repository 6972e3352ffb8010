"""launch / Cluster: results, output, notebook functions, failures, timeouts, no orphans."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import child_pids, wait_gone

import minipar
from minipar import collectives
from minipar.runtime.worker import where_waiting


def rank_square():
    return minipar.rank() ** 2


def test_results_in_rank_order(cluster4):
    assert cluster4.run(rank_square) == [0, 1, 4, 9]


def test_args_kwargs_and_collectives(cluster4):
    def scaled_sum(scale, offset=0):
        t = torch.tensor([float(minipar.rank() + 1)])
        dist.all_reduce(t)
        return t.item() * scale + offset

    assert cluster4.run(scaled_sum, 2, offset=1) == [21.0] * 4


def test_function_defined_in_a_notebook_cell(cluster4):
    # A cell's code lives in a module nobody can import: it must travel by value.
    cell = {"__name__": "__notebook_cell__", "minipar": minipar}
    exec(textwrap.dedent("""
        FACTOR = 10
        def cell_fn(x):
            return (minipar.rank(), minipar.world_size(), x * FACTOR)
    """), cell)
    assert cluster4.run(cell["cell_fn"], 3) == [(r, 4, 30) for r in range(4)]
    assert cluster4.run(lambda: minipar.rank() + 100) == [100, 101, 102, 103]


def test_device_is_cpu_and_one_thread(cluster2):
    assert cluster2.run(lambda: (str(minipar.device()), torch.get_num_threads())) == [
        ("cpu", 1)] * 2


def test_output_comes_back_in_rank_order_every_time(cluster4, capsys):
    def chatty():
        time.sleep(0.02 * (3 - minipar.rank()))  # finish in reverse order
        print(f"hello {minipar.rank()}")
        print("line two")
        print(f"warn {minipar.rank()}", file=sys.stderr)

    texts = []
    for _ in range(2):
        results = cluster4.run(chatty)
        out, err = capsys.readouterr()
        texts.append(out)
        assert results.outputs[2] == "hello 2\nline two\n"
        assert err == "".join(f"[rank {r}] warn {r}\n" for r in range(4))
    expected = "".join(f"[rank {r}] hello {r}\n[rank {r}] line two\n" for r in range(4))
    assert texts == [expected, expected]


def test_timeline_collects_every_rank(cluster2):
    def work():
        with minipar.record("compute", "matmul", step=3):
            torch.ones(64, 64) @ torch.ones(64, 64)
        return None

    timeline = cluster2.run(work).timeline
    assert [e.rank for e in timeline] == [0, 1] or sorted(e.rank for e in timeline) == [0, 1]
    assert all(e.label == "matmul" and e.step == 3 and e.end >= e.start >= 0 for e in timeline)


def _threads_after_making_groups(n: int) -> int:
    """Make `n` groups (all ranks, as torch requires), use them, and count this rank's threads."""
    for _ in range(n):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=group)
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_groups_a_run_made_end_as_the_next_run_starts(cluster2):
    """A gloo group keeps threads that poll its sockets: groups left behind by earlier runs
    would pile up in a long-lived Cluster (a session's, a notebook's) and eat the CPU."""
    baseline = cluster2.run(_threads_after_making_groups, 0)
    inside = cluster2.run(_threads_after_making_groups, 10)
    after = cluster2.run(_threads_after_making_groups, 0)
    assert all(i > b for i, b in zip(inside, baseline, strict=True))  # they had threads
    assert after == baseline
    # the next run still makes and uses groups (names and tags stay in step across ranks)
    assert cluster2.run(lambda: _threads_after_making_groups(1) > 0) == [True, True]


def _loop_thread_policies() -> dict[str, list[int]]:
    """Each gloo loop thread's scheduling policy, after start-up and after a mesh's groups;
    the groups `new_groups` hands this rank."""
    from minipar.mesh import Mesh
    from minipar.runtime import new_groups
    from minipar.runtime.gloo_threads import LOOP_THREAD

    def policies():
        tids = [t for t in os.listdir("/proc/self/task")
                if open(f"/proc/self/task/{t}/comm").read().strip() == LOOP_THREAD]
        return [os.sched_getscheduler(int(t)) for t in tids]

    started = policies()
    groups = Mesh(dp=2).connect()
    collectives.all_reduce(torch.ones(3), group=groups.dp)  # the new group's loop works
    alone, first_only = new_groups([[0], [1]]), new_groups([[0]])
    return {"started": started, "mesh": policies(), "alone": dist.get_process_group_ranks(alone),
            "first_only": first_only is not None,
            "caller": os.sched_getscheduler(threading.get_native_id())}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")
def test_gloo_loop_threads_cannot_preempt_the_thread_holding_their_lock():
    """gloo's loop thread spins while another thread holds its connection's lock: waking
    on a busy core it must not preempt that thread (runtime/gloo_threads.py), so every
    loop thread, the start's and each new group's, runs in SCHED_BATCH from birth, and
    the thread that made them keeps its own policy. Fresh ranks: the shared ones may
    still hold the loop threads of groups other tests made with torch's own calls."""
    with minipar.Cluster(2, backend="gloo", timeout=30) as cluster:
        everyone = cluster.run(_loop_thread_policies)
    for seen in everyone:
        assert seen["caller"] == os.SCHED_OTHER, seen
        assert seen["started"] and set(seen["started"]) == {os.SCHED_BATCH}, seen
        assert len(seen["mesh"]) > len(seen["started"]), seen  # the mesh's groups have theirs
        assert set(seen["mesh"]) == {os.SCHED_BATCH}, seen
    assert [(s["alone"], s["first_only"]) for s in everyone] == \
        [([0], True), ([1], False)]  # each rank's own group, None where it is in none


def test_start_method_spawn_works():
    with minipar.Cluster(2, backend="gloo", start_method="spawn", timeout=30) as cluster:
        assert cluster.run(lambda: minipar.rank() * 5) == [0, 5]


def test_failing_rank_is_named_fast_and_cluster_restarts():
    with minipar.Cluster(4, backend="gloo", timeout=30) as cluster:
        pids = cluster.pids

        def fail_on_rank_2():
            if minipar.rank() == 2:
                raise ValueError("boom on purpose")
            dist.recv(torch.zeros(1), src=2)  # the others block on the failed rank

        started = time.monotonic()
        with pytest.raises(minipar.RankError) as info:
            cluster.run(fail_on_rank_2)
        assert time.monotonic() - started < 5
        assert info.value.rank == 2
        assert "ValueError: boom on purpose" in str(info.value)
        assert "fail_on_rank_2" in info.value.remote_traceback
        assert wait_gone(pids) == []
        # The next run starts fresh ranks and says so in `restarts`.
        assert cluster.run(rank_square) == [0, 1, 4, 9]
        assert cluster.restarts == 1
        new_pids = cluster.pids
    assert wait_gone(new_pids) == []
    with pytest.raises(RuntimeError, match="Cluster is closed"):
        cluster.run(rank_square)


def test_crashing_rank_is_reported():
    with pytest.raises(minipar.RankError, match="rank 1 exited with code 3"):
        minipar.launch(lambda: os._exit(3) if minipar.rank() == 1 else time.sleep(30), 2,
                       backend="gloo", timeout=20)


def test_deadlock_times_out_naming_waiting_ranks():
    def everyone_receives():
        dist.recv(torch.zeros(1), src=(minipar.rank() + 1) % 2)  # nobody sends

    cluster = minipar.Cluster(2, backend="gloo", timeout=30)
    pids = cluster.pids
    started = time.monotonic()
    with pytest.raises(minipar.RankTimeout) as info:
        cluster.run(everyone_receives, timeout=1.5)
    # 1.5 s from entering the function, not the cluster's 30: a generous bound on a busy machine
    assert time.monotonic() - started < 25
    assert sorted(info.value.waiting) == [0, 1]
    assert all("recv" in where for where in info.value.waiting.values())
    assert "everyone_receives" in str(info.value)
    assert wait_gone(pids) == []
    cluster.close()


def _steps_for(seconds: float) -> int:
    """Small all-reduces, one every 0.1 s, for `seconds`: a healthy run that makes
    progress all along and lasts longer than its watchdog's window."""
    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        minipar.collectives.all_reduce(torch.ones(2))
        time.sleep(0.1)
        steps += 1
    return steps


def test_the_timeout_is_a_watchdog_on_progress_not_a_budget_for_the_run(cluster2):
    # 4 s of steps under a 1.5 s timeout: before issue 69 this was a RankTimeout
    steps = cluster2.run(_steps_for, 4.0, timeout=1.5)
    assert min(steps) > 15


def test_a_timeout_in_a_command_is_one_line_naming_the_rank_and_the_flag(capsys):
    from minipar.cli import run_command
    from minipar.runtime.errors import RankTimeout

    def body():
        raise RankTimeout(120, {1: "in recv() at p2p.py:40", 0: "in wait() at p2p.py:55"})

    assert run_command("minipar train", body) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("minipar train: no rank made progress for 120s: rank 0 waited in "
                          "wait() at p2p.py:55") and err.endswith("pass a larger --timeout")


class SlowToUnpickle:
    """An argument that takes 3 s to arrive on a rank, as a task can on a busy machine."""

    def __reduce__(self):
        return (time.sleep, (3,))


@pytest.mark.slow  # waits out a timeout on purpose
def test_the_timeout_counts_from_entering_the_function_not_from_sending_it(cluster2):
    def receive_from_nobody(_):
        dist.recv(torch.zeros(1), src=(minipar.rank() + 1) % 2)

    # the 1 s budget starts once each rank is in the function: the 3 s start is not a deadlock,
    # and the advice names where the function waits, never "no stack available"
    with pytest.raises(minipar.RankTimeout) as info:
        cluster2.run(receive_from_nobody, SlowToUnpickle(), timeout=1)
    assert all("receive_from_nobody" in where for where in info.value.waiting.values()), \
        info.value.waiting
    assert cluster2.run(lambda _: minipar.rank(), SlowToUnpickle(), timeout=1) == [0, 1]


def test_unpicklable_return_value_is_explained(cluster2):
    with pytest.raises(minipar.RankError, match="cannot be pickled"):
        cluster2.run(lambda: threading.Lock())


@pytest.mark.slow  # kills a caller and waits for its ranks to go
def test_no_rank_outlives_its_caller(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, minipar
        if __name__ == "__main__":
            c = minipar.Cluster(2, backend="gloo")
            print(" ".join(map(str, c.pids)), flush=True)
            time.sleep(60)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        owner.kill()
        owner.wait()
    assert wait_gone(pids, seconds=10) == []


@pytest.mark.slow  # waits for an orphaned rank to notice and leave
def test_a_rank_its_launcher_lost_track_of_leaves_too(tmp_path):
    """Ctrl-C can cut a rank's start short: the rank runs, but its launcher never learned
    its pid, so cannot kill it. It must still leave when its group stops, or the launcher
    waits for it at exit (and the caller reading the launcher's output waits too)."""
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent("""
        import threading, time, minipar
        if __name__ == "__main__":
            c = minipar.Cluster(2, backend="gloo")
            threading.Thread(target=c.run, args=(time.sleep, 600), daemon=True).start()
            time.sleep(1)  # both ranks are now busy, not reading their pipes
            lost = c._group.procs.pop()  # as if its start had been cut short
            print(lost.pid, flush=True)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = owner.communicate(timeout=30)
    finally:
        owner.kill()
    assert owner.returncode == 0 and wait_gone([int(out.split()[0])], seconds=10) == []


def test_launch_returns_and_leaves_nothing():
    before = child_pids()
    results = minipar.launch(lambda: os.getpid(), 3, backend="gloo", timeout=30)
    assert len(set(results)) == 3
    assert wait_gone(results) == []
    # What may stay are multiprocessing's two helpers: the forkserver that later
    # launches fork ranks from, and its resource tracker; neither has children left.
    for helper in child_pids() - before:
        with open(f"/proc/{helper}/cmdline") as f:
            command = f.read()
        assert "multiprocessing.forkserver" in command or "resource_tracker" in command, command
        assert child_pids(helper) == set()


@pytest.mark.parametrize("bad, error, words", [
    (0, ValueError, "world_size must be >= 1"),
    (-2, ValueError, "world_size must be >= 1"),
    (2.0, TypeError, "world_size must be an int"),
    (True, TypeError, "world_size must be an int"),
    ("4", TypeError, "world_size must be an int"),
])
def test_bad_world_size(bad, error, words):
    with pytest.raises(error, match=words):
        minipar.launch(rank_square, bad)


def test_bad_backend_timeout_and_function():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'gloo', 'nccl'"):
        minipar.launch(rank_square, 2, backend="mpi")
    if minipar.runtime.gpu_count() < 2:
        with pytest.raises(ValueError, match="use backend='gloo'"):
            minipar.launch(rank_square, 2, backend="nccl")
    with pytest.raises(ValueError, match="timeout must be"):
        minipar.launch(rank_square, 2, timeout=0)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="must be picklable"):
        minipar.launch(lambda: lock.locked(), 2)
    with pytest.raises(TypeError, match="fn must be a function"):
        minipar.launch("rank_square", 2)
    with pytest.raises(ValueError, match="start_method"):
        minipar.Cluster(2, start_method="fork")


def test_where_waiting_reads_a_stack_dump():
    torch_dir = os.path.dirname(torch.__file__)
    runtime = minipar.runtime.__file__
    dump = textwrap.dedent(f"""\
        Thread 0x00007f01 (most recent call first):
          File "{runtime}", line 10 in watch

        Current thread 0x00007f02 (most recent call first):
          File "{torch_dir}/distributed/distributed_c10d.py", line 2400 in recv
          File "{torch_dir}/distributed/c10d_logger.py", line 81 in wrapper
          File "<cell>", line 3 in my_step
          File "{runtime}", line 200 in _run_task
          File "{runtime}", line 250 in _worker_main
    """)
    assert where_waiting(dump) == (
        "in recv() at distributed_c10d.py:2400, called from my_step() at <cell>:3")
    assert "no stack" in where_waiting("")


@pytest.mark.slow  # starts torchrun per module
@pytest.mark.parametrize("module", ["minipar.basics", "minipar.collectives",
                                    "minipar.data_parallel", "minipar.pipeline",
                                    "minipar.tensor_parallel", "minipar.moe"])
def test_torchrun_mode_joins_the_process_group(module):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # on the faked device, as spawned ranks are in the demos' tests (issue 69)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               MINIPAR_FAKED_DEVICE="1")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", module],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "matches one process?" in done.stdout and " NO " not in done.stdout
    checked = re.search(r"(\d+)/(\d+) checked cases match one process", done.stdout)
    assert checked and checked.group(1) == checked.group(2) != "0", done.stdout


def _one_dies():
    if minipar.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return minipar.rank()


def test_tolerate_deaths_keeps_the_survivors_results():
    results = minipar.launch(_one_dies, 3, backend="gloo", timeout=30, tolerate_deaths=True)
    assert results[0] == 0 and results[2] == 2
    assert isinstance(results[1], minipar.RankDied) and results[1].exitcode == -9
    with pytest.raises(minipar.RankError, match="rank 1 exited with code -9"):
        minipar.launch(_one_dies, 3, backend="gloo", timeout=30)


def test_auto_never_falls_back_quietly_when_there_are_gpus_but_too_few(monkeypatch):
    from minipar.runtime import device as device_module

    module = sys.modules["minipar.runtime.device"]  # the package's `device` is the function
    assert device_module is not module
    monkeypatch.setattr(module, "gpu_count", lambda: 0)
    assert module.resolve_backend("auto", 4) == "gloo"  # no GPU: CPU processes, as asked
    monkeypatch.setattr(module, "gpu_count", lambda: 2)
    monkeypatch.setattr(module.dist, "is_nccl_available", lambda: True)
    assert module.resolve_backend("auto", 2) == "nccl"
    with pytest.raises(ValueError, match=r"4 ranks per machine and 2 GPU\(s\).*"
                                         r"backend='gloo', device='cuda'"):
        module.resolve_backend("auto", 4)
    monkeypatch.setattr(module, "gpu_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="sees one GPU .*CUDA_VISIBLE_DEVICES"):
        module.resolve_backend("auto", 8)
    monkeypatch.setattr(module, "exclusive_process_gpus", lambda: [0])
    with pytest.raises(ValueError, match="EXCLUSIVE_PROCESS"):
        module.check_sharing("cuda", "gloo", 4)
    module.check_sharing("cuda", "gloo", 1)  # one rank per GPU: nothing to share
