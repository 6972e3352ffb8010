"""The life-cycle diagram's order of collectives is FSDP's own, with and without prefetch."""

import pytest
import torch

from minipar.data_parallel import shard
from minipar.models import mlp
from minipar.sharded import FullyShardedDataParallel, unit_lifecycle
from minipar.widgets import render_lifecycle


def _one_step(prefetch):
    model = mlp([4, 8, 8, 8, 4], seed=0, dtype=torch.float64)
    fsdp = FullyShardedDataParallel(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                    prefetch=prefetch)
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    fsdp(shard(x)).pow(2).mean().backward()
    fsdp.step()


@pytest.mark.parametrize("prefetch", [False, True])
def test_lifecycle_order_is_a_real_steps(cluster2, prefetch):
    timeline = cluster2.run(_one_step, prefetch).timeline
    real = [e.label for e in sorted(timeline.for_rank(0), key=lambda e: e.start)
            if e.kind in ("all_gather", "reduce_scatter")]
    names = {"gather": "gather unit {}", "reduce-scatter": "reduce-scatter unit {}"}
    drawn = [names[m.action].format(m.unit) for m in unit_lifecycle(4, prefetch)
             if m.action in names]
    assert real == drawn


def test_at_most_one_unit_whole_without_prefetch_and_two_with():
    assert max(len(m.whole) for m in unit_lifecycle(5)) == 1
    assert max(len(m.whole) for m in unit_lifecycle(5, prefetch=True)) == 2
    assert unit_lifecycle(3)[-1].whole == frozenset()


def test_the_drawing_names_every_moment_above_its_column():
    moments = unit_lifecycle(3, prefetch=True)
    ax = render_lifecycle(moments).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [m.label for m in moments]


def test_bad_units_is_one_line():
    with pytest.raises(ValueError, match="units must be an int >= 1"):
        unit_lifecycle(0)
