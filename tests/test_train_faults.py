"""Faults inside a step (train/faults.py): a rank that raises mid-forward, hangs while the
others wait in a collective, or finds the disk full while checkpointing ends the job with
an error naming the rank and the cause, and the last complete checkpoint stays the latest.
Under torchrun --max-restarts 1 a SIGKILLed worker is restarted with the others and the
trainer resumes on its own, ending on the very weights of an uninterrupted run."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

import minipar
from minipar.slow_networks.checkpoint_restart import latest_step
from minipar.train.config import to_toml
from minipar.train.faults import Fault
from minipar.train.loop import train
from minipar.train.sharded_checkpoint import checkpoint_dir, consolidate

pytestmark = pytest.mark.slow  # kills and restarts trainer ranks, some under torchrun


def _every_two(config, steps=6):
    return replace(config, train=replace(config.train, steps=steps, checkpoint_every=2,
                                         eval_every=0))


def test_a_rank_raising_mid_forward_names_the_rank_and_the_step(corpus, tmp_path):  # noqa: F811
    config = _every_two(tiny(corpus, dp=2))
    with pytest.raises(minipar.RankError, match="rank 1 raised mid-forward at step 3") as err:
        minipar.launch(train, 2, config, tmp_path, False, False, None, Fault("raise", 1, 3),
                       timeout=30)
    assert err.value.rank == 1 and "InjectedFault" in str(err.value)
    assert latest_step(checkpoint_dir(tmp_path)) == 2


def test_a_hanging_rank_ends_in_a_timeout_naming_the_collective(corpus, tmp_path):  # noqa: F811
    config = _every_two(tiny(corpus, dp=2))
    with pytest.raises(minipar.RankTimeout) as err:
        minipar.launch(train, 2, config, tmp_path, False, False, None, Fault("hang", 1, 3),
                       timeout=8)
    # rank 0 waits for rank 1 inside the step's gradient all-reduce; rank 1 sleeps
    assert "all_reduce" in err.value.waiting[0], err.value.waiting
    assert "during_step() at faults.py" in err.value.waiting[1], err.value.waiting
    assert latest_step(checkpoint_dir(tmp_path)) == 2


def test_a_full_disk_keeps_the_previous_checkpoint_latest(corpus, tmp_path):  # noqa: F811
    config = _every_two(tiny(corpus, dp=2))
    with pytest.raises(minipar.RankError, match="No space left on device") as err:
        minipar.launch(train, 2, config, tmp_path, False, False, None,
                       Fault("disk-full", 1, 4), timeout=30)
    assert err.value.rank == 1 and "step 4" in str(err.value)
    assert latest_step(checkpoint_dir(tmp_path)) == 2


@pytest.mark.parametrize("text", ["kill", "kill@1", "boom@1:3", "kill@x:3", "kill@1:0"])
def test_a_malformed_fault_is_one_line(text):
    with pytest.raises(ValueError, match="must be KIND@RANK:STEP") as err:
        Fault.parse(text)
    assert "\n" not in str(err.value)


def test_torchrun_restarts_a_killed_worker_and_the_trainer_resumes_alone(corpus, tmp_path):  # noqa: F811
    config = _every_two(tiny(corpus, dp=2))
    (tmp_path / "run.toml").write_text(to_toml(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", "-m", "minipar.train",
               "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "elastic"),
               "--fault", "kill@1:5", "--timeout", "30"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # the first attempt dies at step 5 (checkpoint at 4); the restart resumes after step 4
    assert "resuming after step 4 of 6" in done.stdout, done.stdout
    minipar.launch(train, 2, config, tmp_path / "whole", timeout=60)
    _, step, weights = consolidate(tmp_path / "elastic")
    _, whole_step, whole = consolidate(tmp_path / "whole")
    assert step == whole_step == 6
    assert all(torch.equal(weights[name], whole[name]) for name in whole)
