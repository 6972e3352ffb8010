"""SkipPipe: paths that skip and reorder middle stages, planned by speed; the simulator's
step time falls when a slow stage is visited less; a real run on 5 ranks equals the same
paths on one process."""

import pytest
import torch

import minipar
from minipar.models import mse, regression_data
from minipar.pipeline.skippipe import (
    one_process_paths,
    plan_paths,
    simulate_paths,
    skip_model,
    train_paths,
)

STAGES, MICRO, STEPS, LR = 5, 6, 3, 0.1
SPEEDS = [1.0, 1.0, 0.25, 1.0, 1.0]  # stage 2 is four times slower


def _model():
    return skip_model(4, 8, STAGES, seed=2)


def _steps():
    x, y = regression_data(STEPS * 12, 4, seed=3, dtype=torch.float64)
    return list(zip(x.split(12), y.split(12), strict=True))


def test_plans_visit_slow_stages_less_and_rotate_the_order():
    paths = plan_paths(STAGES, MICRO, skip=1, speeds=SPEEDS)
    assert all(p[0] == 0 and p[-1] == STAGES - 1 and len(p) == STAGES - 1 for p in paths)
    visits = {j: sum(j in p for p in paths) for j in (1, 2, 3)}
    assert visits[2] < visits[1] and visits[2] < visits[3]
    assert sum(visits.values()) == MICRO * 2
    assert len({p[1] for p in paths}) > 1  # not everyone starts at the same middle stage
    full = plan_paths(STAGES, MICRO, skip=0, reorder=False)
    assert all(p == tuple(range(STAGES)) for p in full)


def test_simulated_step_shrinks_when_the_slow_stage_is_skipped():
    forward = [1 / s for s in SPEEDS]
    full = simulate_paths(plan_paths(STAGES, MICRO, 0, reorder=False), forward, link=0.1)
    skipping = simulate_paths(plan_paths(STAGES, MICRO, 1, SPEEDS), forward, link=0.1)
    assert skipping.makespan < full.makespan
    # every forward and backward of every micro-batch is on the picture
    assert len(full.events) == 2 * MICRO * STAGES


def test_a_send_keeps_its_sender_busy_and_the_link_only_delays():
    """One micro-batch through 3 stages of 1 s each (backward 2 s): 4 messages, each
    0.5 s of its sender's time, by hand 1 + .5 + 1 + .5 + 1 + 2 + .5 + 2 + .5 + 2 = 11 s;
    a link of 0.25 s adds 0.25 s per message."""
    path = [(0, 1, 2)]
    assert simulate_paths(path, [1.0] * 3, send=0.5).makespan == pytest.approx(11.0)
    assert simulate_paths(path, [1.0] * 3, link=0.25, send=0.5).makespan == pytest.approx(12.0)
    # the sender waits for its send before its next operation: two micro-batches on 2 stages
    two = simulate_paths([(0, 1), (0, 1)], [1.0, 1.0], send=0.5)
    second = [e for e in two.events if e.rank == 0 and e.label == "F1"][0]
    assert second.start == pytest.approx(1.5)


@pytest.mark.parametrize("skip", [0, 1])
@pytest.mark.slow  # a SkipPipe run on fresh ranks
def test_real_run_equals_the_same_paths_on_one_process(skip, tmp_path):
    plans = [plan_paths(STAGES, MICRO, skip, SPEEDS, reorder=skip > 0)] * STEPS
    results = minipar.launch(train_paths, STAGES, _model, _steps(), plans, mse, LR,
                             backend="gloo", timeout=60)
    model = _model()
    losses = one_process_paths(model, _steps(), plans, mse, LR)
    assert results[-1][0] == pytest.approx(losses, rel=1e-10)
    for r, (_, params) in enumerate(results):
        want = torch.nn.utils.parameters_to_vector(model[r].parameters()).detach()
        assert torch.allclose(params, want, rtol=1e-10, atol=1e-12), r


def test_bad_plans_say_what_to_change():
    with pytest.raises(ValueError, match="skip must be from 0 to 3"):
        plan_paths(STAGES, MICRO, skip=4)
    with pytest.raises(ValueError, match="speeds must give 5 positive numbers"):
        plan_paths(STAGES, MICRO, skip=1, speeds=[1.0])
    with pytest.raises(ValueError, match="stages must be >= 3"):
        skip_model(4, 8, 2)
