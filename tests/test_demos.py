"""Every technique's demo (what `python -m minipar.<technique>` and `minipar tour` run)
matches one process on real ranks."""

import pytest

from minipar.basics import demo as basics
from minipar.collectives import demo as collectives
from minipar.context_parallel import demo as context_parallel
from minipar.data_parallel import demo as data_parallel
from minipar.demo import WIDTH, Check, Row, combine, format_rows, skip
from minipar.mesh import demo as mesh
from minipar.moe import demo as moe
from minipar.pipeline import demo as pipeline
from minipar.sharded import demo as sharded
from minipar.slow_networks import demo as slow_networks
from minipar.tensor_parallel import demo as tensor_parallel

# every rank of these tests computes on the faked device (issue 69, conftest.py)
pytestmark = pytest.mark.usefixtures("faked_device_on")


@pytest.mark.parametrize("technique, args", [
    (basics, (("hello", "split_work"), 4, 20)), (collectives, (1 << 12, 1)),
    (data_parallel, ()), (pipeline, ()), (tensor_parallel, ()), (moe, ()),
    (sharded, ()), (mesh, ()), (context_parallel, ()), (slow_networks, ()),
], ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.slow  # every technique's demo, end to end
def test_every_demo_matches_one_process(cluster2, technique, args):
    rows = combine(cluster2.run(technique.demo, *args))
    assert rows
    assert all(row.matches is not False for row in rows), [r for r in rows if not r.matches]
    assert any(row.matches for row in rows)
    assert max(len(line) for line in format_rows(rows).splitlines()) <= WIDTH


def test_demos_on_four_ranks_include_the_parameter_server(cluster4):
    rows = combine(cluster4.run(data_parallel.demo, ("parameter_server",)))
    assert rows[0].matches is True and rows[0].bytes_moved > 0
    rows = combine(cluster4.run(moe.demo))
    assert rows[0].matches is True and "tokens received per rank" in rows[0].note
    assert rows[-1].technique == "MoE, experts over dp=2 x ep=2" and rows[-1].matches is True
    rows = combine(cluster4.run(mesh.demo, 2, 2, 1))
    assert [r.matches for r in rows] == [True, True]
    assert ["ZeRO-1" in r.technique for r in rows] == [False, True]


def test_the_mesh_demo_refuses_degrees_that_do_not_multiply_to_the_ranks(capsys):
    from minipar.demo import run_demo

    with pytest.raises(SystemExit):
        run_demo(mesh.demo, "mesh", argv=["--ranks", "4", "--dp", "3"],
                 options={"dp": (0, "dp"), "pp": (0, "pp"), "tp": (0, "tp")},
                 check_options=mesh.check_options)
    assert "--dp x --pp x --tp must equal --ranks (4); got dp=3 x pp=1 x tp=1" in \
        capsys.readouterr().err


def test_combine_judges_only_ranks_that_checked_something():
    checks = [[Check("x", True, 1.0, 10), Check("y", None, 2.0)],
              [Check("x", None, 3.0, 5), Check("y", None, 1.0)]]
    x, y = combine(checks)
    assert (x.matches, x.seconds, x.bytes_moved, x.ranks) == (True, 3.0, 15, 2)
    assert y.matches is None and y.bytes_moved is None
    assert combine([[Check("x", True, 1.0)], [Check("x", False, 1.0)]])[0].matches is False


def test_the_report_fits_a_terminal_and_says_why_a_case_was_skipped():
    long = "a technique whose name goes on and on " * 3
    rows = [Row(long, 4, True, 12.5, speedup=1.5, bytes_moved=10**12, note="why " * 60),
            *combine([[skip("interleaved 1F1B", "impossible on 3 ranks; it runs with --ranks 2")]])]
    text = format_rows(rows)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    words = " ".join(text.split())
    assert words.count("whose name") == 3 and words.count("why") == 60  # wrapped, not cut
    assert "skipped: impossible on 3 ranks; it runs with --ranks 2" in words
    assert rows[1].skipped and rows[1].matches is None


def test_a_sleeping_straggler_does_the_same_work(cluster2):
    """The tour's slow rank sleeps instead of computing more, so it shows on any number
    of cores; its work, hence the checksum, is every other rank's."""
    from minipar.basics import busy_work, synchronized_steps

    run = cluster2.run(synchronized_steps, 2, 10, slow_rank=1, straggle="sleep")
    assert list(run) == pytest.approx([2 * busy_work(10)] * 2, rel=1e-6)
    assert [e.rank for e in run.timeline if e.kind == "compute"].count(1) == 2
    with pytest.raises(ValueError, match="straggle must be one of work, sleep; got 'nap'"):
        synchronized_steps(straggle="nap")


def test_the_tour_report_in_the_docs_fits_a_terminal():
    """docs/install.md shows a real tour's report; every line of it fits WIDTH columns."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "docs" / "install.md").read_text()
    report = readme.split("The tour prints a report like this one", 1)[1].split("```")[1]
    assert "matches one process?" in report and len(report.splitlines()) > 40
    assert max(len(line) for line in report.splitlines()) <= WIDTH
