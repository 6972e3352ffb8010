"""Two torchrun nodes on one machine: two agents (--nnodes 2, 2 processes each) meet in a
c10d rendezvous and run the tour's techniques, the hierarchical all-to-all across the
nodes torchrun made, and `minipar.train` on dp x tp and dp x pp, whose final weights are
the one-node run's, bit for bit (float64); and, with --max-restarts 1, a worker killed on
one node restarts the workers of both, and the trainer resumes on its own.

The rendezvous store is hosted here, on a port the OS picks (no free-port race), and
both agents join it as clients (`is_host=false`), so neither agent's exit cuts the
other's shutdown short. An agent still running when its peer failed or the deadline
passed is killed with its workers. No --node-rank: under c10d the rendezvous numbers the
nodes (torchrun ignores the flag there); ranks are still node by node."""

import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import child_pids
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)
from two_nodes_tour import TECHNIQUES

from minipar.train.config import to_toml
from minipar.train.loop import train
from minipar.train.sharded_checkpoint import consolidate

AGENT_SECONDS = 150  # a bound for one job on a loaded 2-core machine (about 15 s idle)


def two_nodes(args: list[str], logs, seconds: float = AGENT_SECONDS,
              options: tuple[str, ...] = ()) -> str:
    """Run `args` (torchrun's entry: -m module ...) under two torchrun agents of 2 ranks
    each on this machine, with torchrun's `options` (e.g. --max-restarts 1); their output,
    agent by agent. Fails naming the agent that exited non-zero, with both agents' output."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=seconds))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    files = [logs / f"agent{node}.log" for node in (0, 1)]
    agents = []
    try:
        for path in files:
            with open(path, "w") as out:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                     "--nproc-per-node", "2",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
                     "--rdzv-id", f"minipar-{store.port}",
                     "--rdzv-conf", "is_host=false,join_timeout=60", *options, *args],
                    stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + seconds
        # until both are done; one failing ends the wait (its peer would sit out a timeout)
        while time.monotonic() < deadline and any(a.poll() is None for a in agents) \
                and not any(a.poll() for a in agents):
            time.sleep(0.2)
    finally:
        for agent in agents:
            if agent.poll() is None:
                # torchrun starts each worker in a session of its own: kill them by pid
                for pid in [*child_pids(agent.pid), agent.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                agent.wait()
    output = "\n".join(f"--- agent {n} (exit {a.returncode}) ---\n{p.read_text()}"
                       for n, (a, p) in enumerate(zip(agents, files, strict=True)))
    failed = [n for n, a in enumerate(agents) if a.returncode != 0]
    # killed agents (a peer failed, or the deadline passed) show as exit -9
    assert not failed, f"agents {failed} failed or were stopped:\n{output[-6000:]}"
    return output


@pytest.mark.slow  # two torchrun 'nodes' on this machine
def test_techniques_match_one_process_across_two_nodes(tmp_path):
    output = two_nodes([str(Path(__file__).with_name("two_nodes_tour.py"))], tmp_path)
    summaries = re.findall(r"(\d+)/(\d+) checked cases match one process", output)
    assert len(summaries) == len(TECHNIQUES), output  # one table per technique, on rank 0
    assert all(done == of != "0" for done, of in summaries) and " NO " not in output, output
    # the hierarchical all-to-all took its nodes from torchrun: 2 nodes of LOCAL_WORLD_SIZE 2
    line = next(x for x in output.splitlines() if "MoE, hierarchical" in x)
    assert "torchrun's 2 nodes x 2" in line and " yes " in line, output


@pytest.mark.slow  # two torchrun 'nodes' train
@pytest.mark.parametrize("parallel", [dict(dp=2, tp=2), dict(dp=2, pp=2)],
                         ids=["dp x tp", "dp x pp"])
def test_training_across_two_nodes_ends_on_the_one_node_weights(
        cluster4, corpus, tmp_path, parallel):  # noqa: F811
    config = tiny(corpus, **parallel)
    config = replace(config, train=replace(config.train, steps=6, eval_every=0))
    (tmp_path / "run.toml").write_text(to_toml(config))
    two_nodes(["-m", "minipar.train", "--config", str(tmp_path / "run.toml"),
               "--out", str(tmp_path / "two_nodes"), "--timeout", "60"], tmp_path)
    cluster4.run(train, config, tmp_path / "one_node")
    _, step, weights = consolidate(tmp_path / "two_nodes")
    _, one_step, one_node = consolidate(tmp_path / "one_node")
    assert step == one_step == 6 and weights.keys() == one_node.keys()
    assert all(torch.equal(weights[name], one_node[name]) for name in one_node)


@pytest.mark.slow  # torchrun restarts both nodes after a kill
def test_a_worker_killed_on_one_node_restarts_both_and_the_run_resumes(
        cluster4, corpus, tmp_path):  # noqa: F811
    """Rank 3 (node 1) is SIGKILLed at step 5; both agents restart their workers in a new
    rendezvous round, and rank 0, on the surviving node, resumes after step 4."""
    config = tiny(corpus, dp=2, tp=2)
    config = replace(config, train=replace(config.train, steps=6, eval_every=0,
                                           checkpoint_every=2))
    (tmp_path / "run.toml").write_text(to_toml(config))
    output = two_nodes(["-m", "minipar.train", "--config", str(tmp_path / "run.toml"),
                        "--out", str(tmp_path / "elastic"), "--fault", "kill@3:5",
                        "--timeout", "60"], tmp_path, options=("--max-restarts", "1"))
    # both agents exited 0 (two_nodes checks): had the surviving node kept its old
    # workers, they would wait at step 5 for the dead rank, and no new round could form
    assert "resuming after step 4 of 6" in output, output
    cluster4.run(train, config, tmp_path / "whole")
    _, step, weights = consolidate(tmp_path / "elastic")
    _, whole_step, whole = consolidate(tmp_path / "whole")
    assert step == whole_step == 6
    assert all(torch.equal(weights[name], whole[name]) for name in whole)
