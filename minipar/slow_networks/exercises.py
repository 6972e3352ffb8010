"""Lesson 10's checks, graded on real ranks.

- `check_push_sum`: push-sum gossip on 4 ranks over a directed graph whose ranks send and
  receive different numbers of messages (where the push-sum weights matter);
- `check_resume`: a 2-rank run is killed (SIGKILL) after its step-4 checkpoint, a step-6
  checkpoint is left half-written, and the learner's `resume(directory, model,
  optimizer)` must restart a 3-rank run where the complete checkpoint left off;
- `check_error_feedback`: top-k compression whose residual carries what was not sent.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives, runtime
from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..models import mlp, mse, regression_data
from ..runtime import RankError, launch, rank
from .checkpoint_restart import latest_step, train_resumable

# out-peers: rank 0 sends to two ranks, rank 2 receives from two; strongly connected
IRREGULAR = {0: [1, 2], 1: [2], 2: [0, 3], 3: [0]}
PUSH_SUM_STEPS = 60


def _start(r: int) -> torch.Tensor:
    return torch.tensor([float(r * r + 1), 10.0 * r], dtype=torch.float64,
                        device=runtime.device())


def _gossip(push_sum: Callable) -> dict:
    """On one rank: PUSH_SUM_STEPS push-sum steps of the learner's function; the totals of x and w
    over all ranks after each step (torch's all-reduce: a measurement, not graded)."""
    me = rank()
    x, w = _start(me), 1.0
    sources = [r for r, outs in IRREGULAR.items() if me in outs]
    totals = []
    for _ in range(PUSH_SUM_STEPS):
        # copies: a learner's in-place update must not change the x we keep, nor our peer lists
        out = push_sum(x.clone(), w, list(IRREGULAR[me]), list(sources))
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
            return {"shape": repr(type(out).__name__)}
        x, w = out[0].to(torch.float64), float(out[1])
        total = torch.cat([x, x.new_tensor([w])])
        dist.all_reduce(total)
        totals.append(total.tolist())
    return {"z": (x / w).tolist(), "totals": totals}


def check_push_sum(push_sum: Callable) -> str:
    """`push_sum(x, w, peers, sources)` on every rank: keep 1/(d+1) of (x, w), send
    1/(d+1) to each of the d `peers`, add what arrives from `sources`; return (x, w)."""
    refuse_library("push_sum", push_sum)
    results = run_on_ranks("push_sum", _gossip, 4, push_sum, crash_hints={
        "size": "receive a buffer shaped like what is sent: x and w travel together "
                "(e.g. torch.cat([x * share, x.new_tensor([w * share])]))"})
    for r, got in enumerate(results):
        if "shape" in got:
            raise ExerciseError(f"push_sum: rank {r} returned a {got['shape']}; return a "
                                "tuple (x, w): the new numerator tensor and the new weight")
    want_x = sum(_start(r) for r in IRREGULAR)
    totals = results[0]["totals"]
    for step, total in enumerate(totals):
        x_sum, w_sum = torch.tensor(total[:-1], dtype=torch.float64), total[-1]
        if not torch.allclose(x_sum, want_x) or abs(w_sum - len(IRREGULAR)) > 1e-9:
            raise ExerciseError(
                f"push_sum: after step {step} the ranks' x add up to {x_sum.tolist()} and "
                f"their w to {w_sum:g}, but gossip must conserve both ({want_x.tolist()} "
                f"and {len(IRREGULAR)}): keep one share of (x, w) and send one share to each "
                "peer, shares of 1/(number of peers + 1), and add everything that arrives.")
    average = want_x / len(IRREGULAR)
    for r, got in enumerate(results):
        z = torch.tensor(got["z"], dtype=torch.float64)
        if not torch.allclose(z, average, rtol=1e-6, atol=1e-9):
            raise ExerciseError(
                f"push_sum: after {PUSH_SUM_STEPS} steps rank {r} holds x / w = {z.tolist()}, "
                f"not the average {average.tolist()}. Here ranks receive different numbers of "
                "messages, so x alone drifts: w must travel with x (send w's share, add the "
                "weights that arrive) and the model is x / w.")
    return (f"push_sum: every rank reaches the average (x / w) in {PUSH_SUM_STEPS} steps on a "
            f"graph where ranks send to 1 or 2 peers; x and w conserved at every step")


RESUME_STEPS, EVERY, LR = 8, 2, 0.05


def _model() -> torch.nn.Module:
    return mlp([6, 12, 1], seed=4, dtype=torch.float64)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_data(RESUME_STEPS * 12, 6, seed=5, dtype=torch.float64)
    return list(zip(x.split(12), y.split(12), strict=True))


def _interrupted(directory: Path) -> None:
    """Two ranks killed at step 5 (checkpoint at 4), then a step-6 folder holding only
    rank 0's file, with zeroed weights: a checkpoint that never completed."""
    try:
        launch(train_resumable, 2, _model, _batches(), mse, LR, directory, EVERY,
               kill_at=(1, 5), backend="gloo", timeout=30)
    # the SIGKILL at step 5 is the point: the launch is expected to fail
    except RankError:
        pass
    if latest_step(directory) != 4:
        raise RuntimeError("the interrupted run did not leave its step-4 checkpoint")
    state = torch.load(directory / "step-4" / "rank-0.pt", weights_only=True)
    state["steps_done"] = 6
    # zeroed weights: a resume that wrongly loads step 6 is caught by its weights too
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    (directory / "step-6").mkdir()
    torch.save(state, directory / "step-6" / "rank-0.pt")


def _probe(resume: Callable, directory: Path) -> dict:
    """On one rank: the learner's resume into a fresh model and optimizer, against the
    step-4 checkpoint's state."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    start = resume(directory, model, optimizer)
    saved = torch.load(directory / "step-4" / "rank-0.pt", weights_only=True, map_location="cpu")
    same_model = all(torch.equal(v.cpu(), saved["model"][k])
                     for k, v in model.state_dict().items())
    buffers = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
    want = [s.get("momentum_buffer") for s in saved["optimizer"]["state"].values()]
    same_momentum = all(b is not None and torch.equal(b.cpu(), w)
                        for b, w in zip(buffers, want, strict=True))
    return {"start": start if isinstance(start, int) else repr(start), "rank": rank(),
            "model": same_model, "momentum": same_momentum}


def check_resume(resume: Callable) -> str:
    """`resume(directory, model, optimizer) -> steps done`: load the latest complete
    checkpoint (named in directory/latest) into model and optimizer, this rank's file or
    rank 0's when it has none; return its steps done (0 and no change when there is none)."""
    refuse_library("resume", resume)
    with tempfile.TemporaryDirectory(prefix="minipar-resume-") as folder:
        directory = Path(folder)
        _interrupted(directory)
        probes = run_on_ranks("resume", _probe, 3, resume, directory, crash_hints={
            "rank-2.pt": "has no file: the run that wrote the checkpoint had 2 ranks. Data-"
                         "parallel state is the same on every rank, so read rank 0's file "
                         "when yours does not exist",
            "No such file": "looked for a file that is not there: read the step number from "
                            "directory / 'latest', then directory / f'step-{N}' / "
                            "'rank-R.pt' (yours, or rank 0's)"})
        for p in probes:
            r, start = p["rank"], p["start"]
            if not isinstance(start, int):
                raise ExerciseError(f"resume: rank {r} returned {start}; return the steps "
                                    "done stored in the checkpoint, an int")
            if start == 0:
                raise ExerciseError(f"resume: rank {r} returned 0, so the run starts over "
                                    "and steps 0-3 count twice; return the checkpoint's "
                                    "steps_done (4 here)")
            if start == 6:
                raise ExerciseError(f"resume: rank {r} loaded step 6, which never completed "
                                    "(only rank 0 wrote it): trust directory / 'latest', "
                                    "which names the last step every rank wrote")
            if start != 4:
                raise ExerciseError(f"resume: rank {r} returned {start}; the latest complete "
                                    "checkpoint is after step 4")
            if not p["model"]:
                raise ExerciseError(f"resume: rank {r}'s model is not the checkpoint's: "
                                    "model.load_state_dict(state['model'])")
            if not p["momentum"]:
                raise ExerciseError(f"resume: rank {r}'s optimizer lost its momentum "
                                    "buffers; restore them too: "
                                    "optimizer.load_state_dict(state['optimizer'])")
        resumed = run_on_ranks("resume", train_resumable, 3, _model, _batches(), mse, LR,
                               directory, EVERY, 0.9, None, resume)
        fresh = launch(train_resumable, 3, _model, _batches(), mse, LR, directory / "fresh",
                       EVERY, backend="gloo", timeout=30)
        for r, ((_, got), (_, want)) in enumerate(zip(resumed, fresh, strict=True)):
            if not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
                raise ExerciseError(f"resume: after resuming, rank {r}'s final weights differ "
                                    "from an uninterrupted run's")
    return ("resume: a run killed after step 4 restarts on 3 ranks from the complete "
            "checkpoint (not the half-written step 6), momentum included, and ends where an "
            "uninterrupted run ends")


_FEEDBACK_STEPS, _FEEDBACK_SIZE, _FEEDBACK_K = 6, 20, 3


def _feedback_gradient(rank: int, step: int) -> torch.Tensor:
    # a seed per (rank, step): the checker regenerates any rank's gradient on its own
    # a CPU generator draws on the host: moved just below
    grad = torch.randn(_FEEDBACK_SIZE, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1000 * rank + step))
    return grad.to(runtime.device())


def _topk_reference(grad: torch.Tensor, residual: torch.Tensor, k: int,
                    by: Callable = torch.abs) -> tuple:
    """(sent, new residual) when keeping the k entries of grad + residual largest by `by`."""
    corrected = grad + residual
    keep = by(corrected).topk(k).indices
    sent = torch.zeros_like(corrected).index_put_((keep,), corrected[keep])
    return sent, corrected - sent


def _run_feedback(fn: Callable) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each step: compress this rank's gradient, average what was sent over the ranks (the
    update every rank applies). Returns each step's (sent, residual) and the applied sum."""
    residual = torch.zeros(_FEEDBACK_SIZE, dtype=torch.float64, device=runtime.device())
    applied = torch.zeros_like(residual)
    steps = []
    for step in range(_FEEDBACK_STEPS):
        grad = _feedback_gradient(runtime.rank(), step)
        # clones: a learner's in-place edit must not change the tensors we check against
        sent, residual = fn(grad.clone(), residual.clone(), _FEEDBACK_K)
        sent, residual = torch.as_tensor(sent), torch.as_tensor(residual)
        if sent.shape != grad.shape or residual.shape != grad.shape:
            raise ValueError(f"step {step}: return two tensors shaped like the gradient "
                             f"{tuple(grad.shape)}; got {tuple(sent.shape)} and "
                             f"{tuple(residual.shape)}")
        applied += collectives.all_reduce(sent.to(torch.float64).clone(), op="avg")
        steps.append((sent.to(torch.float64), residual.to(torch.float64)))
    return steps, applied


def check_error_feedback(topk_with_error_feedback: Callable, world_size: int = 2) -> str:
    """Run `topk_with_error_feedback(grad, residual, k) -> (sent, residual)` for a few steps
    on real ranks. Each step must send the k largest-magnitude entries of grad + residual
    (zeros elsewhere) and keep the rest as the next residual, so that over the run the
    applied averages plus the mean residual add up to the mean gradients: nothing is lost."""
    refuse_library("topk_with_error_feedback", topk_with_error_feedback)
    got = run_on_ranks("topk_with_error_feedback", _run_feedback, world_size,
                       topk_with_error_feedback)
    for r, (steps, _) in enumerate(got):
        residual = torch.zeros(_FEEDBACK_SIZE, dtype=torch.float64)
        for step, (sent, their_residual) in enumerate(steps):
            grad = _feedback_gradient(r, step)
            want_sent, want_residual = _topk_reference(grad, residual, _FEEDBACK_K)
            where = f"topk_with_error_feedback: rank {r}, step {step}"
            if int((sent != 0).sum()) > _FEEDBACK_K:
                raise ExerciseError(f"{where}: sent {int((sent != 0).sum())} nonzero entries; "
                                    f"keep only the k = {_FEEDBACK_K} largest, zeros elsewhere")
            if not torch.allclose(sent, want_sent):
                alone, _ = _topk_reference(grad, torch.zeros_like(grad), _FEEDBACK_K)
                by_value, _ = _topk_reference(grad, residual, _FEEDBACK_K, by=lambda t: t)
                why = ("you compressed this step's gradient alone: add the residual first "
                       "(corrected = grad + residual), or what was dropped is lost for good"
                       if step > 0 and torch.allclose(sent, alone) else
                       "that keeps the largest values; keep the largest magnitudes "
                       "(corrected.abs().topk(k)), negative entries matter as much"
                       if torch.allclose(sent, by_value) else
                       "send the k largest-magnitude entries of grad + residual, zeros elsewhere")
                raise ExerciseError(f"{where}: sent the wrong entries: {why}")
            if not torch.allclose(their_residual, want_residual):
                why = (" It is what the corrected gradient lost (grad + residual - sent), "
                       "not grad - sent." if torch.allclose(their_residual, grad - sent) else
                       " It is grad + residual - sent.")
                raise ExerciseError(f"{where}: the residual is wrong.{why}")
            residual = want_residual
    # error feedback's invariant (Seide et al. 2014; Karimireddy et al. 2019): what was applied
    # plus what is still held back equals everything that was computed
    gradients = sum(_feedback_gradient(r, s) for r in range(world_size)
                    for s in range(_FEEDBACK_STEPS)) / world_size
    mean_residual = sum(steps[-1][1] for steps, _ in got) / world_size
    for r, (_, applied) in enumerate(got):
        if not torch.allclose(applied + mean_residual, gradients):
            raise ExerciseError(f"topk_with_error_feedback: on rank {r} the applied updates plus "
                                "the mean residual differ from the mean gradients")
    return (f"topk_with_error_feedback: right on {world_size} ranks for {_FEEDBACK_STEPS} steps; "
            "applied + mean residual = mean gradients, nothing lost")
