"""Fault tolerance: a rank killed by SIGKILL mid-run; the run resumes from the last
complete checkpoint on fewer ranks and ends where an uninterrupted run ends; under
torchrun --max-restarts the restarted workers do the same."""

import os
import subprocess
import sys

import pytest
import torch

import minipar
from minipar.slow_networks.checkpoint_restart import latest_step, train_resumable
from minipar.slow_networks.elastic import batches, model, mse

pytestmark = pytest.mark.slow  # kills and restarts ranks, some under torchrun

STEPS = 8


def test_a_killed_rank_resumes_on_fewer_ranks_as_if_uninterrupted(tmp_path):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(minipar.RankError) as died:
        minipar.launch(train_resumable, 4, model, batches(STEPS), mse, 0.05, ckpt, 2,
                       kill_at=(2, 5), backend="gloo", timeout=30)
    assert "rank 2" in str(died.value)
    assert latest_step(ckpt) == 4  # steps 0-3 saved; step 4 ran but never checkpointed
    resumed = minipar.launch(train_resumable, 3, model, batches(STEPS), mse, 0.05, ckpt, 2,
                             backend="gloo", timeout=30)
    fresh = minipar.launch(train_resumable, 3, model, batches(STEPS), mse, 0.05,
                           tmp_path / "fresh", 2, backend="gloo", timeout=30)
    for (losses, params), (all_losses, reference) in zip(resumed, fresh, strict=True):
        assert len(losses) == STEPS - 4 and losses == pytest.approx(all_losses[4:], rel=1e-12)
        assert torch.allclose(params, reference, rtol=1e-12, atol=1e-14)


def test_forgetting_the_optimizer_state_would_show(tmp_path):
    """The check above can fail: resuming without momentum buffers ends elsewhere."""
    ckpt = tmp_path / "ckpt"
    minipar.launch(train_resumable, 2, model, batches(4), mse, 0.05, ckpt, 2, backend="gloo",
                   timeout=30)
    state = torch.load(ckpt / "step-4" / "rank-0.pt", weights_only=True)
    assert state["optimizer"]["state"], "momentum buffers are part of the checkpoint"


def test_torchrun_restarts_the_workers_and_they_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", "-m",
               "minipar.slow_networks.elastic", "--dir", str(ckpt), "--steps", str(STEPS),
               "--kill-at", "1:5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # the first attempt dies at step 5 (checkpoint at 4); the restarted one runs steps 4-7
    assert "attempt 2: ran 4 steps" in done.stdout, done.stdout
    fresh = minipar.launch(train_resumable, 2, model, batches(STEPS), mse, 0.05,
                           tmp_path / "fresh", 2, backend="gloo", timeout=30)
    assert torch.allclose(torch.load(ckpt / "final.pt"), fresh[0][1], rtol=1e-12, atol=1e-14)
