"""Inside a rank: the process minipar starts, and how it reports back.

A worker joins the process group, then loops: receive a task (a function sent by
value), run it with a common t=0, send back its result and recorded events, or the
traceback of what it raised. Its output goes to files the launcher replays.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import trace
from . import progress
from .device import _bind_device, faked_for_task, nccl_device_id, on_the_host, on_this_device, rank
from .gloo_threads import calm_from_birth

STARTUP_TIMEOUT = 60.0
IN_RANK_ENV = "MINIPAR_IN_RANK"  # set in every process minipar starts
_TASK_FRAME = "_run_task"  # the worker frame that calls the user's function
_entered_file = ""  # this rank's <rank>.entered: when it last entered the user's function


def entered_path(io_dir: str, rank_: int) -> str:
    """The file where a rank writes the time (time.monotonic, one clock for every process
    on the machine) at which it entered the task's function: the launcher's timeout counts
    from there, so a busy machine's slow start is not mistaken for a deadlock."""
    return os.path.join(io_dir, f"{rank_}.entered")


def in_rank() -> bool:
    """True inside a process started by minipar (where starting more ranks is refused)."""
    return os.environ.get(IN_RANK_ENV) == "1"


def _die_with_parent(lifeline: Any) -> None:
    """End this rank when its group is stopped or the launching process goes away, so no
    rank is orphaned: `lifeline` is the read end of a pipe whose only write end the
    launcher holds, and reads end-of-file the moment the launcher closes it or exits (even
    as a zombie nobody has reaped yet, and even for a rank whose start the launcher was
    interrupted in and never learned of)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (the forkserver)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        try:
            lifeline.recv_bytes()  # nothing is ever sent: this returns only at end-of-file
        except (EOFError, OSError):
            pass
        # os._exit, not sys.exit: in this thread sys.exit would end only the thread, and the
        # main thread may be blocked in a collective
        os._exit(1)

    threading.Thread(target=watch, name="minipar-lifeline", daemon=True).start()


def _redirect_output(out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    # line-buffered, so what a rank printed is in the file even if it is killed mid-run;
    # closefd=False: fds 1 and 2 stay open for C++ code (torch, gloo) that writes to them
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)


def _flush_output() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)  # C++ prints from torch/gloo
    except (OSError, AttributeError):
        pass


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code down, without the worker's own frames."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None \
            and tb.tb_frame.f_code.co_name in ("_worker_main", _TASK_FRAME):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


def _run_task(task: bytes) -> tuple:
    fn, args, kwargs, path, faked = cloudpickle.loads(task)
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    _end_groups_of_the_last_task()
    dist.barrier()  # a common t=0 for every rank's events
    # the caller's choice: on a CPU, compute on the faked device (runtime/faked_device.py)
    with trace.capture(rank()) as captured, faked_for_task(faked, rank()):
        with open(_entered_file, "w") as f:
            f.write(repr(time.monotonic()))
        progress.beat()
        # the arguments arrive on this rank's device, the answer goes back on the host
        args, kwargs = on_this_device((args, kwargs))
        result = on_the_host(fn(*args, **kwargs))
    return result, captured.events


def _end_groups_of_the_last_task() -> None:
    """Destroy the process groups the last task created: every group but the default one.
    Each gloo group keeps threads of its own that wake many times a second to poll its
    sockets: a Cluster that had run a few hundred meshes spent a large share of the CPU on
    idle threads, and everything else on the machine slowed. Safe with no barrier: the
    launcher sends a task only once every rank has replied to the last one, so no peer is
    still using them; and not at the end of a task, where a peer may still be reading."""
    # torch's registry of this process's groups (private, but the one complete list: meshes,
    # DeviceMesh and FSDP make groups through several public calls)
    for group in [g for g in c10d._world.pg_map if g is not dist.group.WORLD]:
        dist.destroy_process_group(group)


def _worker_main(rank_: int, size: int, backend: str, device: str, io_dir: str,
                 lifeline: Any, threads: int, conn: Any) -> None:
    global _entered_file
    _die_with_parent(lifeline)
    _entered_file = entered_path(io_dir, rank_)
    progress.attach(io_dir, rank_)
    try:
        _redirect_output(os.path.join(io_dir, f"{rank_}.out"),
                         os.path.join(io_dir, f"{rank_}.err"))
        stack_file = open(os.path.join(io_dir, f"{rank_}.stack"), "w")
    except FileNotFoundError:  # the group was stopped (and its files removed) before this
        os._exit(1)            # rank began, e.g. Ctrl-C during start-up: leave quietly
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # the variables torchrun sets, so code written for torchrun reads the same values here
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(size), LOCAL_RANK=str(rank_),
                      LOCAL_WORLD_SIZE=str(size), **{IN_RANK_ENV: "1"})
    if backend == "gloo":
        # every rank would otherwise start one thread per core: K ranks on one machine would run
        # K times as many threads as cores and slow each other down (oversubscription)
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # already fixed in this process
            pass
        # gloo otherwise picks the interface its hostname resolves to, which may not route to
        # itself; all ranks are on this machine, so loopback. setdefault: a user's choice wins
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    try:
        _bind_device(backend, rank_, device)
        # the ranks meet through a file in the group's own folder: no port to collide on, and
        # no name lookup. A TCPStore on loopback looks up 127.0.0.1's name for each peer it
        # logs; where the DNS server drops that query, a start waited the resolver's 5 s
        store = dist.FileStore(os.path.join(io_dir, "rendezvous"), size)
        # timeout: long, so that the launcher's own timeout (which reports where each rank
        # waits) fires first, not gloo's terse one
        # its loop thread must not preempt a lock holder (gloo_threads.py)
        with calm_from_birth():
            dist.init_process_group(backend, store=store, rank=rank_, world_size=size,
                                    timeout=datetime.timedelta(hours=1),
                                    device_id=nccl_device_id(backend))
        conn.send_bytes(cloudpickle.dumps(("ready", None)))
    except BaseException:
        # the launcher reports a failed start with this traceback, not just an exit code
        conn.send_bytes(cloudpickle.dumps(("error", traceback.format_exc())))
        _flush_output()
        os._exit(1)
    while True:
        try:
            # end-of-file: the launcher closed our pipe (stop() or close()), so leave the loop
            task = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            result, events = _run_task(task)
            try:
                reply = cloudpickle.dumps(("ok", (result, events)))
            except Exception as err:
                raise TypeError(f"the return value of rank {rank_} cannot be pickled "
                                f"({err}); return tensors, numbers or plain containers") from None
        # BaseException: even SystemExit or KeyboardInterrupt in the user's function is reported and
        # the rank stays ready for the next task
        except BaseException as err:
            reply = cloudpickle.dumps(("error", _user_traceback(err)))
        _flush_output()  # before the reply: the launcher replays the files once it has it
        conn.send_bytes(reply)
    _flush_output()
    os._exit(0)  # skip interpreter teardown: nothing is left to flush


_FRAME = r'File "([^"]+)", line (\d+) in (\S+)'
_STDLIB = os.path.dirname(threading.__file__)  # threading.py, queue.py: waiting, not work
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collective_of(frames: list[tuple[str, str, str]]) -> tuple[str, str, str] | None:
    """The outermost frame of a thread inside a collective: minipar's collectives (not
    the background thread's loop) or torch.distributed's."""
    places = (os.path.join(_PACKAGE, "collectives"), os.path.join(os.path.dirname(
        torch.__file__), "distributed"))
    inside = [f for f in frames if f[0].startswith(places) and
              not f[0].endswith("background.py")]
    return inside[-1] if inside else None


def where_waiting(stack_dump: str) -> str:
    """Summarize a faulthandler dump: the innermost call of the task's thread (past the
    standard library's waiting), and the user's line that led to it. When that thread
    waits on a background thread (a CommThread), say which collective that thread is in:
    the call the deadlock is about."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack_dump)
    block = next((b for b in reversed(blocks) if _TASK_FRAME in b), "")
    frames = re.findall(_FRAME, block)
    if not frames:
        return "still running (no stack available)"
    depth = next((i for i, frame in enumerate(frames) if frame[2] == _TASK_FRAME), len(frames))
    # faulthandler lists the innermost first; a wait in threading/queue names its caller
    inner = next((f for f in frames[:depth] if not f[0].startswith(_STDLIB)), frames[0])
    library = (os.path.dirname(torch.__file__), _PACKAGE, _STDLIB)
    users = [f for f in frames[:depth] if not f[0].startswith(library)]
    user = users[0] if users else frames[max(depth - 1, 0)]
    where = f"in {inner[2]}() at {os.path.basename(inner[0])}:{inner[1]}"
    if user != inner:
        where += f", called from {user[2]}() at {os.path.basename(user[0])}:{user[1]}"
    if inner[0].endswith("background.py"):  # waiting for the CommThread: what is it in?
        for other in blocks:
            collective = _collective_of(re.findall(_FRAME, other)) if other != block else None
            if collective:
                where += (f"; its background thread waits in {collective[2]}() at "
                          f"{os.path.basename(collective[0])}:{collective[1]}")
                break
    return where
