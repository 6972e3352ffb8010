"""`minipar train --dry-run`: the layout built on the meta device over torch's fake
process group holds, stage by stage, what real ranks build for the same config; 1,024
ranks print every group and finish in one process; what it cannot do is one line."""

import builtins
from dataclasses import replace

import pytest

from minipar.train.__main__ import main as train_main
from minipar.train.config import load_config
from minipar.train.dry_run import _ranks_text, dry_run, part_counts, stage_parts
from minipar.train.loop import build_part

LAYOUT = {"parallel.dp": 1, "parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 1,
          "parallel.microbatches": 2, "parallel.sequence_parallel": True}


def _config(**more):
    return load_config("tiny", {**LAYOUT, **more})


def _built_on_this_rank(config):
    return part_counts(build_part(config))[:2]


@pytest.mark.parametrize("zero", [1, 3])
def test_each_stage_holds_what_real_ranks_build(zero, cluster4):
    config = _config(**{"parallel.zero": zero, "parallel.dp": 1})
    real = cluster4.run(_built_on_this_rank, config)  # pp 2 x tp 2: ranks 0, 1 | 2, 3
    dry = stage_parts(config, 4)
    for stage in dry:
        mine = [real[r] for r in range(4) if r // 2 == stage["stage"]]
        # every tp rank of a stage holds the same shapes, and the dry run counts them exactly
        assert all(m == (stage["held"], stage["updated"]) for m in mine), (stage, mine)
        assert stage["bytes_per_value"] == 4  # fp32 weights


def test_a_thousand_ranks_in_one_process(tmp_path, capsys):
    code = train_main(["--dry-run", "--ranks", "1024", "--tp", "4", "--pp", "4", "--layers",
                       "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4",
                       "--batch-size", "512", "--microbatches", "8", "--zero", "1",
                       "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "1024 ranks as Mesh(pp=4, replicate=1, dp=64, ep=1, cp=1, tp=4)" in printed
    table = (tmp_path / "dry_run.txt").read_text().splitlines()
    rank_5 = next(line.split() for line in table if line.split()[:1] == ["5"])
    # rank 5: pp 0, dp 1, tp 1; its pp group strides by 256, dp by 4, tp is 4-7
    assert rank_5 == ["5", "0", "1", "1", "5-773", "by", "256", "1-253", "by", "4", "4-7"]
    last = next(line.split() for line in table if line.split()[:1] == ["1023"])
    assert last[:4] == ["1023", "3", "63", "3"]
    assert "memory per rank by kind" in printed and "optimizer" in printed


def test_group_text():
    assert _ranks_text([3]) == "3" and _ranks_text([0, 1, 2]) == "0-2"
    assert _ranks_text([1, 9, 17]) == "1-17 by 8" and _ranks_text([0, 1, 5]) == "0,1,5"


def test_what_it_cannot_do_is_one_line(monkeypatch, capsys, tmp_path):
    # a config no rank could build: refused before anything is built
    code = train_main(["--dry-run", "--ranks", "8", "--tp", "8", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "tp" in err, err
    code = train_main(["--dry-run", "--check", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "leave out --check" in err, err
    # a torch without the private fake process group
    real_import = builtins.__import__

    def no_fake_pg(name, *args, **kwargs):
        if name.endswith("fake_pg"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fake_pg)
    with pytest.raises(ValueError, match="fake process group") as err:
        dry_run(_config(), 4)
    assert "\n" not in str(err.value)


def _inside_ranks():
    try:
        dry_run(replace(_config(), parallel=replace(_config().parallel, pp=1, tp=1)), 1)
    except ValueError as err:
        return str(err)
    return None


def test_refused_inside_running_ranks(cluster2):
    assert "run it from the command line" in cluster2.run(_inside_ranks)[0]


def test_the_readmes_dry_run(tmp_path, capsys):
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "train --dry-run" in line)
    argv = line.split("minipar train ", 1)[1].split()
    assert train_main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "built each of the 8 pipeline stages' parts" in printed
    assert len((tmp_path / "dry_run.txt").read_text().splitlines()) > 1024
