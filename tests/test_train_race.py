"""The race against torch's own composition (train/torch_native.py, train/torch_race.py): torch's
FSDP2, DTensor tensor parallelism and pipelining, given the trainer's model, weights and
batches, reach the trainer's losses, norms and weights in float64; the bench runs."""

from dataclasses import replace

import pytest
import torch

import minipar
from minipar.tensor_parallel import twin_slice
from minipar.train.config import TrainConfig, load_config
from minipar.train.loop import train
from minipar.train.torch_native import refuse_native
from minipar.train.torch_race import (
    ROWS,
    measure,
    race_config,
    report,
    run_steps,
)

pytestmark = pytest.mark.slow  # races torch's own composition, trainer jobs on both sides

STEPS = 10


def _tiny(parallel: dict) -> TrainConfig:
    """The race's run on the tiny preset in float64; a V (two stages per rank) needs one
    block per stage, so 4 blocks where tiny has 2."""
    config = race_config(parallel, STEPS, preset="tiny", precision="fp64")
    stages = parallel.get("pp", 1) * parallel.get("virtual", 1)
    return replace(config, model=replace(config.model, layers=max(config.model.layers, stages)))


def _both(ours: dict, parallel: dict) -> dict:
    """On every rank: 10 float64 steps by the trainer's own loop (layout `ours`) and by
    torch's composition (`parallel`); the losses, norms, and the weights that differ."""
    mine = train(_tiny(ours), keep_weights=True)
    config = _tiny(parallel)
    theirs = run_steps(config, native=True, keep_weights=True)
    tp = parallel.get("tp", 1)
    tp_rank = minipar.rank() % tp  # tp fastest on both meshes
    names = set(theirs["weights"])
    differ = [n for n, w in theirs["weights"].items()
              if not torch.allclose(mine.weights[n], twin_slice(w, mine.weights[n], tp_rank, tp),
                                    rtol=1e-10, atol=1e-13)]
    return {"losses": (mine.losses, [r["loss"] for r in theirs["records"]]),
            "norms": ([r["grad_norm"] for r in mine.records],
                      [r["grad_norm"] for r in theirs["records"]]),
            "names": (names, set(mine.weights)), "differ": differ}


@pytest.mark.parametrize("row", list(ROWS))
def test_torch_composition_reaches_the_trainers_losses_and_weights(row, request):
    """dp: FSDP2 against ZeRO-3; tp: DTensor Colwise/RowwiseParallel; pp: torch's
    Schedule1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV (the tied weight's two
    stages on one rank);
    dp x tp: FSDP2 over DTensor against ZeRO-3 over tp, the pairs the race times. The
    same 10 losses and gradient norms as the trainer's loop, and the same weights after
    them, in float64."""
    ours, parallel = ROWS[row][:2]
    ranks = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
    cluster = request.getfixturevalue(f"cluster{ranks}")
    for r, result in enumerate(cluster.run(_both, ours, parallel, timeout=120)):
        mine, theirs = result["losses"]
        assert len(mine) == STEPS and mine[-1] < mine[0] - 0.1  # it trained
        assert theirs == pytest.approx(mine, rel=1e-12, abs=0)
        assert result["norms"][1] == pytest.approx(result["norms"][0], rel=1e-10, abs=0)
        torch_names, minipar_names = result["names"]
        assert torch_names and torch_names <= minipar_names, f"rank {r}"
        assert result["differ"] == [], f"rank {r}"


@pytest.mark.parametrize("overrides, words", [
    ({"parallel.cp": 2}, "cp = ep = 1"),
    ({"parallel.pp": 2, "parallel.dp": 2}, "pp=2 alone"),
    ({"parallel.pp": 2, "parallel.schedule": "interleaved_1f1b", "parallel.virtual": 2,
      "parallel.microbatches": 2}, "runs 'gpipe', '1f1b', 'zb_v'"),
    ({"train.precision": "bf16"}, "train.precision"),
    ({"parallel.dp": 2}, "but 1 ranks run"),
])
def test_what_torchs_composition_does_not_cover_is_one_line(overrides, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        refuse_native(load_config("tiny", overrides))


def test_the_race_bench_runs_and_reports(tmp_path):
    """Two rounds of the 2-D row on one Cluster: the second round's DTensor run must not
    find the first one's mesh (its groups destroyed) in DTensor's sharding cache. The
    pipeline row carries its schedule's floor."""
    rows = measure(steps=3, rounds=2, preset="tiny", rows=("dp=2 tp=2", "pp=2 1f1b m=4"))
    table = report(rows, tmp_path)
    assert len(rows[0]["ratios"]) == 2
    assert "schedule_floor_s" not in rows[0] and rows[1]["schedule_floor_s"] > 0
    assert "the schedule's floor" in table
    assert rows[0]["minipar_tokens_per_s"] > 0 and rows[0]["torch_tokens_per_s"] > 0
    assert rows[0]["minipar_profile"]["messages"] > 0 and rows[0]["torch_profile"]["ops"] > 0
    assert "dp=2 tp=2" in table and "minipar / torch" in table
    assert (tmp_path / "bench_train_vs_torch.json").exists()
    with pytest.raises(ValueError, match="rows must be among"):
        measure(rows=("dp=3",))
