"""TeraPipe: token slices through the pipeline equal one process; the slicing DP is optimal."""

import itertools

import pytest
import torch

from minipar.context_parallel.terapipe import (
    best_slices,
    check_terapipe_against_twin,
    pipeline_latency,
)
from minipar.pipeline import schedule, simulate


def _assert_equal_to_twin(results):
    twin = results[0]["twin_grads"]
    got = {}
    for r in results:
        for name, g in r["grads"].items():
            name = "embed.weight" if name == "head_weight" else name
            got[name] = g if name not in got else got[name] + g  # the tied copies add up
    assert set(got) == set(twin)
    for name, g in got.items():
        assert torch.allclose(g, twin[name], rtol=1e-9, atol=1e-12), name
    last = results[-1]
    assert abs(last["loss"] - last["reference_loss"]) < 1e-12


@pytest.mark.parametrize("sizes", [[8], [4, 4], [2, 2, 2, 2], [5, 2, 1]],
                         ids=lambda s: "-".join(map(str, s)))
def test_terapipe_on_two_stages_equals_one_process(cluster2, sizes):
    _assert_equal_to_twin(cluster2.run(check_terapipe_against_twin, sizes))


def test_terapipe_on_four_stages_equals_one_process(cluster4):
    _assert_equal_to_twin(cluster4.run(check_terapipe_against_twin, [3, 3, 2, 2, 1, 1]))


def test_the_bubble_shrinks_with_more_slices():
    bubbles = [simulate(schedule("terapipe", 4, m), {"F": 1 / m, "B": 2 / m})
               .summary(4).bubble_fraction for m in (1, 2, 4, 8, 16)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[0] == pytest.approx(3 / 4) and bubbles[-1] == pytest.approx(3 / 19)


@pytest.mark.parametrize("per_pair, per_slice", [(0.0, 0.0), (0.05, 2.0), (1.0, 5.0)])
def test_best_slices_is_optimal(per_pair, per_slice):
    found = best_slices(12, 4, 1.0, per_pair, per_slice=per_slice)
    assert sum(found) == 12
    brute = min((c for n in range(1, 13) for c in _compositions(12, n)),
                key=lambda c: pipeline_latency(c, 4, 1.0, per_pair, per_slice))
    assert pipeline_latency(found, 4, 1.0, per_pair, per_slice) == pytest.approx(
        pipeline_latency(brute, 4, 1.0, per_pair, per_slice))


def test_later_tokens_get_shorter_slices_and_beat_every_equal_slicing():
    args = (1.0, 0.5)
    uneven = best_slices(2048, 8, *args, unit=64, per_slice=20000)
    assert uneven[0] > uneven[-1] and uneven == sorted(uneven, reverse=True)
    equal = min(pipeline_latency([2048 // m] * m, 8, *args, 20000) for m in (1, 2, 4, 8, 16, 32))
    assert pipeline_latency(uneven, 8, *args, 20000) < 0.95 * equal
    with pytest.raises(ValueError, match="multiple of unit"):
        best_slices(10, 2, 1.0, 0.1, unit=4)


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def _without_carried_gradients(sizes):
    from minipar.context_parallel.terapipe import TokenStage

    TokenStage.carried_state = None  # in this rank's process only: the engine skips it
    return check_terapipe_against_twin(sizes)


def test_earlier_slices_need_the_key_value_gradients_of_later_ones():
    import minipar

    with minipar.Cluster(2, backend="gloo", timeout=30) as cluster:  # its own processes
        results = cluster.run(_without_carried_gradients, [4, 4])
    with pytest.raises(AssertionError):
        _assert_equal_to_twin(results)
