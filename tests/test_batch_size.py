import pytest

from minipar.batch_size import global_batch, scaled_learning_rate, steps_and_samples


def test_the_global_batch_multiplies_every_split():
    assert global_batch(4, accumulation=2, dp=8) == 64
    assert global_batch(1, pipeline_microbatches=8, dp=2) == 16


def test_at_the_noise_scale_steps_and_samples_are_both_twice_their_minimum():
    assert steps_and_samples(1000, 1000) == (2.0, 2.0)
    steps, samples = steps_and_samples(100, 1000)  # far below: steps dominate
    assert steps == pytest.approx(11) and samples == pytest.approx(1.1)
    # the paper's hyperbola: (S/S_min - 1)(E/E_min - 1) = 1 at every batch
    for b in (10, 333, 5000):
        s, e = steps_and_samples(b, 1000)
        assert (s - 1) * (e - 1) == pytest.approx(1)


def test_learning_rate_scales_linearly_for_sgd_and_by_the_square_root_for_adam():
    assert scaled_learning_rate(0.1, 256, 1024) == pytest.approx(0.4)
    assert scaled_learning_rate(1e-3, 256, 1024, rule="sqrt") == pytest.approx(2e-3)


@pytest.mark.parametrize("call, match", [
    (lambda: global_batch(0), "micro_batch must be an int >= 1"),
    (lambda: global_batch(2, dp=True), "dp must be an int >= 1"),
    (lambda: steps_and_samples(0, 10), "batch > 0"),
    (lambda: scaled_learning_rate(0.1, 256, 512, rule="cubic"), "rule must be"),
])
def test_bad_input_gets_one_clear_line(call, match):
    with pytest.raises(ValueError, match=match):
        call()
