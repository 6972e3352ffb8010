"""The engine runs every synchronous schedule on real ranks and equals one process:
the loss and every gradient, float64, rtol 1e-10."""

import pytest
import torch

import minipar
from minipar.models import mse, regression_data
from minipar.pipeline import Pipeline, schedule, simulate, split_model
from minipar.pipeline.pipedream import versions_used

SYNC = [("naive", 1, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 3, 1), ("zb_h1", 4, 1),
        ("looped_bfs", 4, 2), ("interleaved_1f1b", 4, 2), ("zb_v", 8, 2), ("dualpipev", 8, 2)]


def _layers(n_stages):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_stages):
        layers += [torch.nn.Linear(6, 6, dtype=torch.float64), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(6, 1, dtype=torch.float64))
    return torch.nn.Sequential(*layers)


def _data():
    return regression_data(10, 6, seed=3, dtype=torch.float64)  # 10: uneven micro-batches



def _reference(n_stages):
    model = _layers(n_stages)
    x, y = _data()
    loss = mse(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _pipeline_run(cases):
    results = {}
    k = minipar.world_size()
    for name, m, v in cases:
        model = _layers(k * v)
        stages = split_model(model, k * v, boundaries=list(range(2, 2 * k * v, 2)))
        pipe = Pipeline(stages, schedule(name, k, m, v))
        x, y = _data()
        loss = pipe.train_step(x, y, mse)
        grads = {(s, i): p.grad.clone() for s, mod in pipe.modules.items()
                 for i, p in enumerate(mod.parameters())}
        results[(name, m, v)] = (loss, grads)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow  # every schedule on fresh ranks
def test_every_synchronous_schedule_equals_one_process(world_size):
    cases = [c for c in SYNC if not (c[0] == "interleaved_1f1b" and c[1] % world_size)]
    results = minipar.launch(_pipeline_run, world_size, cases, backend="gloo", timeout=120)
    for case in cases:
        n_stages = world_size * case[2]
        ref_loss, ref_grads = _reference(n_stages)
        model = _layers(n_stages)
        stages = split_model(model, n_stages, boundaries=list(range(2, 2 * n_stages, 2)))
        # parameters in model order, located by (stage, index within stage)
        where = [(s, i) for s, mod in enumerate(stages) for i, _ in enumerate(mod.parameters())]
        got = {}
        for r in range(world_size):
            loss, grads = results[r][case]
            if loss is not None:
                assert loss == pytest.approx(ref_loss, rel=1e-12), case
            got.update(grads)
        assert len(got) == len(where), case
        for (s, i), ref in zip(where, ref_grads, strict=True):
            assert torch.allclose(got[(s, i)], ref, rtol=1e-10, atol=1e-14), (case, s, i)


def _repeated_steps(cases):
    """Each schedule for three steps on the same weights: the first learns the message
    shapes through the store, the later ones know them."""
    from minipar import collectives
    k, out = minipar.world_size(), {}
    for name, m, v in cases:
        pipe = Pipeline(split_model(_layers(k * v), k * v,
                                    boundaries=list(range(2, 2 * k * v, 2))),
                        schedule(name, k, m, v))
        x, y = _data()
        steps = []
        for _ in range(3):
            for p in pipe.parameters():
                p.grad = None
            with collectives.meter() as meter:
                loss = pipe.train_step(x, y, mse)
            steps.append((loss, [p.grad.clone() for p in pipe.parameters()], meter.sent_bytes))
        out[(name, m, v)] = steps
    return out


def test_later_steps_use_the_shapes_learnt_and_give_the_same_gradients(cluster2):
    cases = [c for c in SYNC if not (c[0] == "interleaved_1f1b" and c[1] % 2)]
    results = cluster2.run(_repeated_steps, cases)
    for case in cases:
        for r, steps in enumerate(results[r][case] for r in range(2)):
            (loss1, grads1, sent1), *later = steps
            for loss, grads, sent in later:
                assert loss == loss1, (case, r)
                assert all(torch.equal(a, b) for a, b in zip(grads, grads1, strict=True)), case
                # shapes travel through the rendezvous store: every step sends the same
                assert sent1 == sent > 0, (case, r, sent1, sent)


def test_split_model_balances_by_parameters_or_takes_boundaries():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1),
                                torch.nn.Linear(1, 1), torch.nn.Linear(1, 50))  # 110, 11, 2, 100
    stages = split_model(model, 2)
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sizes == [110, 113]  # the split with the smallest largest stage
    assert [len(s) for s in split_model(model, 3, boundaries=[1, 3])] == [1, 2, 1]
    with pytest.raises(ValueError, match="boundaries must be 1 increasing"):
        split_model(model, 2, boundaries=[0])
    with pytest.raises(ValueError, match="stages must be an int from 1 to the number of layers"):
        split_model(model, 5)


def _pipedream_run(m, lr):
    k = minipar.world_size()
    pipe = Pipeline(split_model(_layers(k), k, boundaries=list(range(2, 2 * k, 2))),
                    schedule("pipedream", k, m), lr=lr)
    x, y = _data()
    pipe.train_step(x, y, mse)
    return ({s: [p.detach().clone() for p in mod.parameters()] for s, mod in pipe.modules.items()},
            versions_used(pipe.stages))


def _pipedream_reference(k, m, lr):
    """PipeDream semantics in one process, replayed in the simulator's order: each stage's
    forward runs on a copy of its current weights; its backward differentiates that copy
    and updates the live weights at once."""
    stages = split_model(_layers(k), k, boundaries=list(range(2, 2 * k, 2)))
    plan = schedule("pipedream", k, m)
    x, y = _data()
    xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
    saved, grads_in = {}, {}
    for event in sorted(simulate(plan, {"F": 1, "B": 2}), key=lambda e: (e.start, e.rank)):
        s, i = event.stage, event.microbatch
        if event.kind == "F":
            inp = xs[i] if s == 0 else saved[(s - 1, i)][1].detach().requires_grad_(True)
            stash = {n: p.detach().clone().requires_grad_(True)
                     for n, p in stages[s].named_parameters()}
            out = torch.func.functional_call(stages[s], stash, (inp,))
            saved[(s, i)] = (inp, out, stash)
        elif event.kind == "B":
            inp, out, stash = saved[(s, i)]
            root = mse(out, ys[i]) * len(xs[i]) / len(x) if s == k - 1 else out
            wrt = ([inp] if s > 0 else []) + list(stash.values())
            grads = list(torch.autograd.grad(root, wrt, None if s == k - 1 else grads_in[(s, i)]))
            if s > 0:
                grads_in[(s - 1, i)] = grads.pop(0)
            with torch.no_grad():
                for p, g in zip(stages[s].parameters(), grads, strict=True):
                    p -= lr * g
    return {s: [p.detach() for p in mod.parameters()] for s, mod in enumerate(stages)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipedream_backward_uses_the_weights_its_forward_used(world_size):
    m, lr = 5, 0.3
    results = minipar.launch(_pipedream_run, world_size, m, lr, backend="gloo", timeout=60)
    reference = _pipedream_reference(world_size, m, lr)
    for stage_params, _ in results:
        for s, params in stage_params.items():
            for got, want in zip(params, reference[s], strict=True):
                assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), s
    # on the first stage, backwards run after later micro-batches' updates: stale, stashed
    first_stage_versions = results[0][1]
    assert any(live > used for used, live in first_stage_versions.values())
    # and the weights really moved between micro-batches: not one synchronous step
    sync_stages = split_model(_layers(world_size), world_size,
                              boundaries=list(range(2, 2 * world_size, 2)))
    x, y = _data()
    mse(torch.nn.Sequential(*sync_stages)(x), y).backward()
    with torch.no_grad():
        for s_mod in sync_stages:
            for p in s_mod.parameters():
                p -= lr * p.grad
    assert not torch.allclose(results[0][0][0][0], list(sync_stages[0].parameters())[0])


def _both_engines(name):
    """The same model and batch under torch.distributed.pipelining and under minipar."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    k, r = minipar.world_size(), minipar.rank()
    bounds = list(range(2, 2 * k, 2))
    x, y = regression_data(8, 6, seed=5, dtype=torch.float64)  # 4 equal micro-batches
    theirs = split_model(_layers(k), k, boundaries=bounds)
    stage = PipelineStage(theirs[r], r, k, torch.device("cpu"))
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stage, 4, loss_fn=mse)
    if r == 0:
        runner.step(x)
    elif r == k - 1:
        runner.step(target=y, losses=[])
    else:
        runner.step()
    mine = split_model(_layers(k), k, boundaries=bounds)
    Pipeline(mine, schedule(name, k, 4)).train_step(x, y, mse)
    return [(a.grad, b.grad) for a, b in zip(theirs[r].parameters(), mine[r].parameters(),
                                             strict=True)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.slow  # torch's pipelining on fresh ranks beside ours
def test_same_gradients_as_torch_distributed_pipelining(name):
    for pairs in minipar.launch(_both_engines, 3, name, backend="gloo", timeout=60):
        for theirs, mine in pairs:
            assert torch.allclose(theirs, mine, rtol=1e-10, atol=1e-14)


def _activation_peak(name, m):
    k = minipar.world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                  for _ in range(2 * k)])
    pipe = Pipeline(split_model(model, k), schedule(name, k, m), measure_activations=True)
    x = torch.randn(32, 32)
    pipe.train_step(x, x, lambda o, t: ((o - t) ** 2).mean())
    return pipe.activations.peak, pipe.activations.now


def test_measured_activation_memory_follows_the_schedule(cluster2):
    from minipar.pipeline import peak_in_flight

    gpipe = cluster2.run(_activation_peak, "gpipe", 8)
    one_f = cluster2.run(_activation_peak, "1f1b", 8)
    expected = [a / b for a, b in zip(peak_in_flight(schedule("gpipe", 2, 8)),
                                      peak_in_flight(schedule("1f1b", 2, 8)), strict=True)]
    assert [g[0] / o[0] for g, o in zip(gpipe, one_f, strict=True)] == expected  # [4.0, 8.0]
    assert all(now == 0 for _, now in gpipe + one_f)  # every activation freed after the step


def test_measured_and_simulated_runs_use_the_plans_labels(cluster2):
    def run():
        pipe = Pipeline(split_model(_layers(2), 2), schedule("1f1b", 2, 4))
        x, y = _data()
        pipe.train_step(x, y, mse)

    measured = cluster2.run(run).timeline
    plan = schedule("1f1b", 2, 4)
    simulated = simulate(plan, {"F": 1, "B": 2})
    communication = {str(a) for actions in plan.actions for a in actions if not a.is_compute}
    sent_or_received = [e for e in measured if e.kind in ("send", "recv")]
    assert {e.label for e in sent_or_received} == communication
    assert all(e.label == f"{e.stage}{'SEND' if e.kind == 'send' else 'RECV'}_"
                          f"{e.label.split('_')[1][0]}{e.microbatch}" for e in sent_or_received)
    compute = {(e.kind, e.label) for e in measured if e.kind in ("F", "B")}
    assert compute == {(e.kind, e.label) for e in simulated if e.kind in ("F", "B")}
    assert {e.label for e in simulated if e.kind == "recv"} <= communication


def _stage_point_and_hooks():
    """On one rank: a Stage subclass given through make_stage wraps every forward (as
    recomputation would); a loss that raises leaves no saved-tensor hooks behind."""
    from minipar.pipeline import Stage

    calls = []

    class Counted(Stage):
        def forward(self, x, microbatch):
            calls.append((self.index, microbatch))
            return super().forward(x, microbatch)

    x, y = _data()
    pipe = Pipeline(split_model(_layers(1), 1), schedule("gpipe", 1, 2), make_stage=Counted,
                    measure_activations=True)
    pipe.train_step(x, y, mse)

    def broken(out, target):
        raise RuntimeError("loss failed")

    try:
        pipe.train_step(x, y, broken)
    except RuntimeError:
        pass
    before = pipe.activations.now
    kept = torch.tanh(torch.ones(3, requires_grad=True) * 2)  # saves its output for backward
    return calls, pipe.activations.now == before and kept.grad_fn is not None


def test_a_stage_subclass_wraps_forward_and_hooks_come_off_when_the_loss_raises():
    calls, no_hooks_left = minipar.launch(_stage_point_and_hooks, 1, backend="gloo",
                                          timeout=60)[0]
    assert calls[:2] == [(0, 0), (0, 1)]
    assert no_hooks_left


def _evaluate_then_train(cases):
    """Per case: the forward-only loss (before any step at this shape), the step's loss,
    and whether the evaluation left any gradient behind."""
    out = {}
    k = minipar.world_size()
    for name, m, v in cases:
        stages = split_model(_layers(k * v), k * v, boundaries=list(range(2, 2 * k * v, 2)))
        pipe = Pipeline(stages, schedule(name, k, m, v))
        x, y = _data()
        evaluated = pipe.evaluate(x, y, mse)
        clean = all(p.grad is None for p in pipe.parameters())
        out[(name, m, v)] = (evaluated, pipe.train_step(x, y, mse), clean)
    return out


def test_evaluate_runs_the_forward_actions_alone_for_every_synchronous_schedule(cluster2):
    """A validation loss through the pipeline: the training step's loss, no gradients,
    no deadlock, and the training step after it still finds its message shapes."""
    for rank_results in cluster2.run(_evaluate_then_train, SYNC):
        for case, (evaluated, trained, clean) in rank_results.items():
            assert clean, case
            if trained is not None:
                assert evaluated == pytest.approx(trained, rel=1e-12), case
            else:
                assert evaluated is None, case


def _evaluate_pipedream():
    k = minipar.world_size()
    pipe = Pipeline(split_model(_layers(k), k, boundaries=list(range(2, 2 * k, 2))),
                    schedule("pipedream", k, 4), lr=0.1)
    try:
        pipe.evaluate(*_data(), mse)
    except ValueError as err:
        return str(err)
    return None


def test_evaluate_refuses_stages_that_keep_state_from_forward(cluster2):
    assert all("change state in forward" in (msg or "")
               for msg in cluster2.run(_evaluate_pipedream))
