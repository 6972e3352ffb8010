"""`minipar bench train` (train/bench.py): its table from built rows (the ratio cells, the
planner's error, the rank correlation), the planner's step for a composition, and the
ceiling's spec; and, in the slow tier, its data-parallel rows measured for real on the
tiny preset (`bench train-dp`'s path). The whole bench runs 24 rows on up to 8 ranks, too
long for any tier; its figures are in docs/trainer.md."""

import json
import re

import pytest

from minipar.train.bench import (
    BASELINE,
    CEILING,
    NO_REDUCTIONS,
    ROWS,
    VARIANTS,
    _config,
    _spec,
    correlations,
    measure,
    predicted_step,
    report,
    slower_rank_lead,
)
from minipar.train.dp_bench import ROWS as DP_ROWS


def _row(variant: str, ranks: int, step: float, predicted: float | None,
         ratios: list[float]) -> dict:
    return {"variant": variant, "ranks": ranks, "precision": "fp32", "threads": 1,
            "tokens_per_s": 4096 / step, "tokens_per_s_range": [4000 / step, 4200 / step],
            "mfu": 0.5, "peak_per_core": 90e9, "step_s": step, "predicted_step_s": predicted,
            "step_split_s": {"cpu_seconds": 0.8 * step, "other_cpu_seconds": 0.04 * step,
                             "idle_seconds": 0.16 * step, "seconds": step},
            "pace_s": [0.7 * step, 0.8 * step], "slower_rank_lead_s": 0.05 * step,
            "memory": 3 * 2**20, "memory_predicted": 4 * 2**20, "vs_one_process": ratios}


def test_the_table_reads_the_rows_ratios_predictions_and_ranking(tmp_path):
    rows = [_row(BASELINE, 1, 0.40, None, [1.0, 1.0, 1.0]),
            _row("dp=2, fp32", 2, 0.25, 0.20, [1.5, 1.6, 1.7]),
            _row("tp=2, fp32", 2, 0.35, 0.30, [1.1, 1.2, 1.3]),
            _row("pp=2 1f1b m=4, fp32", 2, 0.30, 0.36, [1.2, 1.3, 1.4])]
    # measured order dp < pp < tp; predicted order dp < tp < pp: rho = 1 - 6 * 2 / 24
    assert correlations(rows) == {2: pytest.approx(0.5)}
    table = report(rows, tmp_path)
    assert "1.60x (1.50-1.70)" in table  # dp=2's per-round ratios: median (min-max)
    assert "200 ms (-20%)" in table  # the planner's step and its error against 250 ms
    assert "200 + 10 + 40 of 250" in table  # dp=2's step: own CPU + other threads + neither
    assert "175-200" in table  # dp=2's ranks' own CPU, fastest-slowest
    assert "+12 ms" in table  # dp=2's slower rank over the ranks' mean, per step
    one = next(line for line in table.splitlines() if line.startswith(BASELINE))
    assert re.search(r"320 \+ 16 \+ 64 of 400\s+-\s", one)  # one process: no pace to compare
    assert "3.0 / 4.0" in table  # the fullest rank's memory, measured / predicted, MiB
    assert "2 ranks: Spearman rank correlation, predicted vs measured step = +0.50" in table
    assert table.splitlines()[0].startswith("MFU divides by each row's peak per core")
    assert "against the ceiling" not in table  # no ceiling row: no such line
    ceiling = _row(CEILING, 2, 0.22, None, [1.6, 1.6, 2.0])
    line = report([*rows, ceiling], tmp_path).splitlines()[-2]
    assert line.startswith("dp=2 against the ceiling (two processes, no messages), per "
                           "round: 0.94x (0.85-1.00); in its median round dp=2's slower rank "
                           "computed 12 ms a step longer than the ranks' mean (5% of its step)")
    # the stopwatch row splits that gap, per round: ceiling -> stopwatch -> dp=2
    stopwatch = _row(NO_REDUCTIONS, 2, 0.23, None, [1.52, 1.8, 1.8])
    lines = report([*rows, ceiling, stopwatch], tmp_path).splitlines()
    # stopwatch / ceiling: 0.95, 1.125, 0.90; dp=2 / stopwatch: 0.987, 0.889, 0.944
    assert lines[-2] == ("dp=2 without its gradient reductions (a stopwatch: the ranks still "
                         "meet once a step) against the ceiling, per round: 0.95x (0.90-1.12), "
                         "what stepping together leaves; dp=2 against it: 0.94x (0.89-0.99), "
                         "what its reductions leave (per round the two multiply to dp=2 "
                         "against the ceiling; their medians need not)")
    assert lines[-3].startswith("dp=2 against the ceiling")
    # without the ceiling, dp=2 against the stopwatch still reads
    alone = report([*rows, stopwatch], tmp_path).splitlines()[-2]
    assert alone == "dp=2 against the stopwatch: 0.94x (0.89-0.99), what its reductions leave"
    # a stopwatch faster than the ceiling in its median round is noise, and says so
    noisy = _row(NO_REDUCTIONS, 2, 0.21, None, [1.7, 1.7, 2.1])
    assert "per round: noise: 1.06x (1.05-1.06) > ceiling 1.00x" in report(
        [*rows, ceiling, noisy], tmp_path)
    saved = json.loads((tmp_path / "bench_train.json").read_text())
    assert "dp=2, fp32" in json.dumps(saved)


def test_the_slower_rank_lead_is_what_a_synchronous_step_waits_for_step_by_step():
    runs = [{"own_cpu_steps": [0.30, 0.40, 0.35]}, {"own_cpu_steps": [0.36, 0.30, 0.35]}]
    # per step: max - mean = 0.03, 0.05, 0: the pace a step waits for, not the runs' totals
    # (1.05 and 1.01 s, whose difference would say 0.02 s over three steps)
    assert slower_rank_lead(runs) == pytest.approx(0.08 / 3)
    assert slower_rank_lead(runs[:1]) == 0  # one rank waits for nobody
    with pytest.raises(ValueError):  # ranks that logged different steps: a bug, not a zero
        slower_rank_lead([runs[0], {"own_cpu_steps": [0.3]}])


def test_the_planner_predicts_compositions_but_not_context_parallelism():
    flops, bandwidth, alpha, beta = 50e9, 5e9, 2e-4, 3e-10
    dp = predicted_step(_config("small", dict(dp=2), "fp32", 3), flops, bandwidth, alpha, beta)
    one = predicted_step(_config("small", {}, "fp32", 3), flops, bandwidth, alpha, beta)
    assert 0 < dp < one  # half the batch's compute per rank, plus the reduction
    assert predicted_step(_config("small", dict(cp=2), "fp32", 3), flops, bandwidth, alpha,
                          beta) is None


def test_the_ceiling_runs_dp2s_shape_without_messages_and_every_row_has_a_spec():
    assert _spec(CEILING) == _spec(NO_REDUCTIONS) == _spec("dp=2, fp32")
    assert ROWS[ROWS.index(CEILING) - 1] == "dp=2, fp32"  # printed beside dp=2
    assert ROWS[ROWS.index(NO_REDUCTIONS) - 1] == CEILING
    assert set(ROWS) == {*VARIANTS, CEILING, NO_REDUCTIONS}


def test_rows_the_bench_lacks_or_no_baseline_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="rows must be among the bench's"):
        measure(rows=(BASELINE, "dp=3, fp32"))
    with pytest.raises(ValueError, match="include '1 process, fp32'"):
        measure(rows=("dp=2, fp32",))
    assert set(DP_ROWS) <= set(ROWS) and {BASELINE, CEILING, NO_REDUCTIONS} <= set(DP_ROWS)


@pytest.mark.slow  # spawns 1, 1 and 2 ranks and trains the tiny preset in turns (~25 s)
def test_the_data_parallel_rows_measured_for_real_in_turns(tmp_path):
    rows = measure(steps=4, rounds=2, preset="tiny",
                   rows=(NO_REDUCTIONS, CEILING, "dp=2, fp32", BASELINE))
    # table order; the stopwatch row ran (it raises if it skipped no reduction)
    assert [r["variant"] for r in rows] == [BASELINE, "dp=2, fp32", CEILING, NO_REDUCTIONS]
    assert rows[0]["vs_one_process"] == [1.0, 1.0]  # each round divided by its own baseline
    for r in rows:
        assert len(r["vs_one_process"]) == 2 and all(v > 0 for v in r["vs_one_process"])
        split = r["step_split_s"]
        assert split["cpu_seconds"] > 0
        # neither is what the CPU clocks leave of the step, never below zero: the parts
        # cover the step (more than it only where threads ran at once, and neither is 0)
        parts = split["cpu_seconds"] + split["other_cpu_seconds"] + split["idle_seconds"]
        assert split["idle_seconds"] >= 0 and parts >= split["seconds"] * (1 - 1e-9)
        assert 0 < r["mfu"] <= 1
        assert 0 < r["pace_s"][0] <= r["pace_s"][1]  # fastest rank's own CPU, then slowest's
        # the slower rank's lead over the ranks' mean: never negative; none for one process
        assert r["slower_rank_lead_s"] >= 0 and (r["ranks"] > 1 or r["slower_rank_lead_s"] == 0)
    assert rows[1]["predicted_step_s"] > 0
    assert rows[2]["predicted_step_s"] is None and rows[3]["predicted_step_s"] is None
    table = report(rows, tmp_path, name="train_dp")
    assert "dp=2 against the ceiling" in table and "what its reductions leave" in table
    assert (tmp_path / "bench_train_dp.json").exists()


def test_the_stopwatch_skips_dp_reductions_and_gives_the_method_back():
    from minipar.data_parallel import DataParallel
    from minipar.train.dp_references import gradient_reductions_skipped

    original = DataParallel._all_reduce
    with gradient_reductions_skipped() as skipped:
        assert DataParallel._all_reduce is not original
        DataParallel._all_reduce(None, None)  # a bucket's reduction: counted, nothing sent
        assert skipped == [1]
    assert DataParallel._all_reduce is original  # the bench's ranks run real rows next
    with pytest.raises(KeyError), gradient_reductions_skipped():
        raise KeyError("a failing row")
    assert DataParallel._all_reduce is original  # given back on a failure too
