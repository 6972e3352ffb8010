"""`--compile` (torch.compile per decoder block): the same losses as eager (float64: to
rounding; float32: within float32's tolerance), on one process, across a checkpoint's
stop and resume, and on tp=2 and pp=2; the same parameter names (checkpoints and exports
unchanged); one line where it does not compose. Slow: inductor compiles C++ per rank."""

from dataclasses import replace

import pytest
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

import minipar
from minipar.train.compile_blocks import refuse_uncompilable
from minipar.train.loop import train

# slow: each compiled run pays inductor's C++ compile per rank, 10-40 s here with a warm
# cache and more on a fresh machine (a cold cache, a busy core): its own time limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _config(text: str, compiled: bool, precision: str = "fp64", **parallel):
    base = tiny(text, **parallel)
    return replace(base, train=replace(base.train, steps=4, eval_every=0, compile=compiled,
                                       precision=precision),
                   optim=replace(base.optim, warmup_steps=1))


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("precision, tolerance", [("fp64", 1e-12), ("fp32", 1e-5)])
def test_one_process_compiled_equals_eager_and_resumes(corpus, tmp_path, precision,  # noqa: F811
                                                       tolerance):
    eager = minipar.launch(train, 1, _config(corpus, False, precision), None, True)[0]
    config = _config(corpus, True, precision)
    whole = minipar.launch(train, 1, config, None, True, timeout=600)[0]
    assert _gap(whole.losses, eager.losses) < tolerance
    assert whole.weights.keys() == eager.weights.keys()  # compiled in place: the same names
    minipar.launch(train, 1, config, tmp_path, stop_after=2, timeout=600)
    resumed = minipar.launch(train, 1, config, tmp_path, resume=True, timeout=600)[0]
    assert [r["step"] for r in resumed.records] == [3, 4]  # steps 1-2 came from the checkpoint
    assert _gap(resumed.losses, eager.losses[2:]) < tolerance


@pytest.mark.parametrize("parallel", [dict(tp=2), dict(pp=2, microbatches=2)],
                         ids=["tp=2", "pp=2"])
def test_compiled_blocks_compose_with_tp_and_pp(cluster2, corpus, parallel):  # noqa: F811
    eager = cluster2.run(train, _config(corpus, False, **parallel))[0]
    # the shared ranks' 30 s is for runs, not for two ranks compiling (and taking turns
    # on inductor's cache lock) on a fresh machine
    compiled = cluster2.run(train, _config(corpus, True, **parallel), timeout=600)[0]
    assert _gap(compiled.losses, eager.losses) < 1e-12


@pytest.mark.parametrize("parallel, experts", [(dict(cp=2), 0), (dict(dp=2), 4)])
def test_what_compile_does_not_compose_is_one_line(corpus, parallel, experts):  # noqa: F811
    config = _config(corpus, True, **parallel)
    config = replace(config, model=replace(config.model, experts=experts))
    with pytest.raises(ValueError, match="leave --compile off") as err:
        refuse_uncompilable(config)
    assert "\n" not in str(err.value)
    refuse_uncompilable(replace(config, train=replace(config.train, compile=False)))
