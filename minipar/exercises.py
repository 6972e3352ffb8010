"""Exercise checks and learners' copies of the lessons.

A lesson's exercise is a function whose body sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION``. `minipar lessons --student DIR` writes copies where that part
is replaced by a stub raising NotImplementedError that names the exercise. The
`check_*` functions run the learner's function on real ranks against a
single-process reference and say what is wrong, rank by rank.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .runtime import RankError, RankTimeout, launch

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


class ExerciseError(AssertionError):
    """The learner's function ran but gave a wrong answer; the message says where."""


def _run_on_ranks(name: str, fn: Callable, world_size: int, *args, timeout: float = 30) -> list:
    try:
        return launch(fn, world_size, *args, backend="gloo", timeout=timeout)
    except RankError as err:
        if "NotImplementedError" in str(err):
            raise ExerciseError(f"{name}: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        raise
    except RankTimeout as err:
        waits = "; ".join(f"rank {r} {where}" for r, where in sorted(err.waiting.items()))
        raise ExerciseError(
            f"{name} on {world_size} ranks did not finish in {timeout:g}s: a deadlock? {waits}. "
            "A blocking send can wait for its receiver forever: post each step's send and "
            "receive together (dist.batch_isend_irecv, or isend + irecv and wait on both)."
        ) from None


class _SendLog:
    """Inside a rank: record every message this rank sends (destination, a copy of the data)."""

    def __enter__(self) -> list[tuple[int, torch.Tensor]]:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.sent: list[tuple[int, torch.Tensor]] = []
        self.saved = {name: getattr(c10d, name) for name in ("isend", "send")}
        self.depth = 0  # send() may call isend() inside: log the outermost call only
        for name, original in self.saved.items():
            def logged(*args, _original=original, **kwargs):
                if self.depth == 0:
                    tensor = args[0] if args else kwargs["tensor"]
                    dst = args[1] if len(args) > 1 else kwargs.get("dst",
                                                                   kwargs.get("group_dst"))
                    self.sent.append((int(dst), tensor.detach().clone()))
                self.depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.depth -= 1

            setattr(c10d, name, logged)
            setattr(dist, name, logged)
        return self.sent

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self.saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)


# --- lesson 00: a global mean over ranks that hold different amounts of data ---

def _local_losses(rank: int) -> torch.Tensor:
    """Rank r holds r+1 per-sample losses: the shards are deliberately uneven."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.rand(rank + 1, generator=generator, dtype=torch.float64)


def _call_global_mean(fn: Callable) -> float:
    import minipar

    return float(fn(_local_losses(minipar.rank())))


def check_global_mean_loss(global_mean_loss: Callable, world_size: int = 4) -> str:
    """Run `global_mean_loss(local_losses)` on `world_size` ranks with uneven shards.

    Every rank must return the mean over all samples of all ranks, the number one
    process would compute on the whole batch.
    """
    got = _run_on_ranks("global_mean_loss", _call_global_mean, world_size, global_mean_loss)
    shards = [_local_losses(r) for r in range(world_size)]
    everything = torch.cat(shards)
    expected = float(everything.mean())
    hints = {
        "the mean of the ranks' means: ranks hold different numbers of samples, so weight "
        "each rank by its count (all-reduce the sum and the count)":
            float(torch.stack([s.mean() for s in shards]).mean()),
        "the sum over all samples: divide by the total number of samples":
            float(everything.sum()),
    }
    for rank, value in enumerate(got):
        if math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12):
            continue
        why = next((hint for hint, v in hints.items() if math.isclose(value, v, rel_tol=1e-9)),
                   None)
        if why is None and math.isclose(value, float(shards[rank].mean()), rel_tol=1e-9):
            why = "this rank's own mean: combine the ranks with dist.all_reduce"
        raise ExerciseError(
            f"global_mean_loss: rank {rank} returned {value:.6f}, expected {expected:.6f} "
            f"(the mean of all {everything.numel()} samples)."
            + (f" {value:.6f} is {why}." if why else ""))
    return (f"global_mean_loss: correct on all {world_size} ranks "
            f"({expected:.6f} = mean of {everything.numel()} samples)")


# --- lesson 01: ring all-reduce and tree broadcast ---
# Rank r starts with x[i] = (i + 1) * 2**r, so any message decodes exactly into which
# elements it carries and which ranks have been added into it.

def _marked(rank: int, numel: int) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) + 1) * 2.0**rank


def _contributors(values: torch.Tensor, start: int) -> set[int] | None:
    """The set of ranks summed into a message holding elements start.., or None."""
    masks = values / (torch.arange(values.numel(), dtype=torch.float64) + 1 + start)
    mask = masks[0].item() if values.numel() else 0.0
    if not values.numel() or not torch.all(masks == mask) or mask != int(mask) or mask < 1:
        return None
    return {r for r in range(63) if int(mask) >> r & 1}


def _call_logged(fn: Callable, numel: int, *args) -> tuple[list, list[float]]:
    import minipar

    tensor = _marked(minipar.rank(), numel)
    with _SendLog() as sent:
        fn(tensor, *args)
    return [(dst, t.tolist()) for dst, t in sent], tensor.tolist()


def _ring_problem(k: int, numel: int, results: list) -> str | None:
    from .collectives import split_bounds

    bounds = split_bounds(numel, k)
    total = sum(_marked(r, numel) for r in range(k))
    for step in range(2 * (k - 1)):
        for rank, (sent, _) in enumerate(results):
            where = f"rank {rank}, step {step}"
            if step >= len(sent):
                return (f"{where}: sent nothing; a ring all-reduce sends 2(K-1) = {2 * (k - 1)} "
                        f"messages from every rank (K-1 to reduce-scatter, K-1 to all-gather)")
            dst, values = sent[step]
            if dst != (rank + 1) % k:
                return (f"{where}: sent to rank {dst}; in a ring every rank sends only to its "
                        f"right neighbour, (rank + 1) % K = {(rank + 1) % k}")
            candidates = [c for c in range(k) if bounds[c + 1] - bounds[c] == len(values)]
            decoded = [(c, _contributors(torch.tensor(values, dtype=torch.float64), bounds[c]))
                       for c in candidates]
            decoded = [(c, who) for c, who in decoded if who is not None]
            if not decoded:
                return (f"{where}: sent {len(values)} values that are not one chunk of the "
                        f"tensor (chunks are torch.tensor_split(tensor, {k}))")
            c, who = decoded[0]
            want = min(step + 1, k)
            if step < k - 1:
                expected = {(rank - j) % k for j in range(step + 1)}
                if who != expected:
                    return (f"{where}: sent chunk {c} holding the sum of ranks {sorted(who)}; "
                            f"at reduce-scatter step {step} it should hold {want} ranks' "
                            f"contributions, {sorted(expected)} (add what you received "
                            f"before passing it on)")
            elif who != set(range(k)):
                return (f"{where}: sent chunk {c} holding the sum of ranks {sorted(who)}; in the "
                        f"all-gather phase every chunk sent is already the full sum")
    for rank, (sent, final) in enumerate(results):
        if len(sent) > 2 * (k - 1):
            return (f"rank {rank} sent {len(sent)} messages; a ring all-reduce needs only "
                    f"2(K-1) = {2 * (k - 1)}")
        got = torch.tensor(final, dtype=torch.float64)
        for c in range(k):
            a, b = bounds[c], bounds[c + 1]
            if not torch.equal(got[a:b], total[a:b]):
                return (f"rank {rank}: chunk {c} of the result is {got[a:b].tolist()}, "
                        f"expected {total[a:b].tolist()}")
    return None


def check_ring_all_reduce(ring_all_reduce: Callable, world_sizes: tuple[int, ...] = (2, 3, 4),
                          timeout: float = 15) -> str:
    """Run `ring_all_reduce(tensor)` (a sum, in place) on real ranks and inspect every message.

    Each message must go to the right neighbour and carry one chunk with the right
    ranks added into it: s+1 ranks at reduce-scatter step s, all ranks during the
    all-gather. The first wrong message is reported by rank and step.
    """
    for k in world_sizes:
        numel = 2 * k + 1  # uneven chunks
        results = _run_on_ranks("ring_all_reduce", _call_logged, k, ring_all_reduce, numel,
                                timeout=timeout)
        problem = _ring_problem(k, numel, results)
        if problem:
            raise ExerciseError(f"ring_all_reduce with {k} ranks: {problem}")
    return (f"ring_all_reduce: correct on {', '.join(map(str, world_sizes))} ranks, "
            "2(K-1) messages per rank, each carrying the right partial sum")


def _tree_problem(k: int, src: int, numel: int, results: list) -> str | None:
    data = _marked(src, numel)
    rounds_allowed = math.ceil(math.log2(k))
    received_at: dict[int, int] = {src: 0}
    senders: dict[int, int] = {}
    for rank, (sent, _) in enumerate(results):
        if len(sent) > rounds_allowed:
            return (f"rank {rank} sent {len(sent)} messages; in a binomial tree no rank sends "
                    f"more than ceil(log2 K) = {rounds_allowed} (a root that sends to every "
                    "rank is the naive broadcast)")
        for step, (dst, values) in enumerate(sent):
            if not torch.equal(torch.tensor(values, dtype=torch.float64), data):
                return (f"rank {rank}, step {step}: sent data that is not the source's yet; a "
                        "rank can forward only after it has received")
            if dst in senders or dst == src:
                return f"rank {dst} was sent the data twice (by rank {senders.get(dst, src)})"
            senders[dst] = rank
    pending = dict(senders)
    while pending:  # a rank's round = its sender's round + its place in the sender's order
        progress = False
        for dst, sender in list(pending.items()):
            if sender in received_at:
                order = [d for d, _ in results[sender][0]].index(dst)
                received_at[dst] = received_at[sender] + order + 1
                del pending[dst]
                progress = True
        if not progress:
            return f"ranks {sorted(pending)} were sent data by ranks that never received it"
    missing = sorted(set(range(k)) - set(received_at))
    if missing:
        return f"ranks {missing} never received the data"
    rounds = max(received_at.values())
    if rounds > rounds_allowed:
        last = max(received_at, key=received_at.get)
        return (f"rank {last} gets the data only in round {rounds}; a binomial tree reaches "
                f"every rank in ceil(log2 K) = {rounds_allowed} rounds (every rank that has "
                "the data sends in every round)")
    for rank, (_, final) in enumerate(results):
        if not torch.equal(torch.tensor(final, dtype=torch.float64), data):
            return f"rank {rank} ends with {final}, expected the source's {data.tolist()}"
    return None


def check_tree_broadcast(tree_broadcast: Callable,
                         world_sizes: tuple[int, ...] = (2, 3, 5, 8), timeout: float = 15) -> str:
    """Run `tree_broadcast(tensor, src)` on real ranks for several K and sources.

    Every rank must end with the source's tensor, every message must carry it, each
    rank must receive once, and the last rank must have it after ceil(log2 K) rounds.
    """
    for k in world_sizes:
        for src in sorted({0, k - 1}):
            results = _run_on_ranks("tree_broadcast", _call_logged, k, tree_broadcast, 5, src,
                                    timeout=timeout)
            problem = _tree_problem(k, src, 5, results)
            if problem:
                raise ExerciseError(f"tree_broadcast with {k} ranks from src={src}: {problem}")
    return (f"tree_broadcast: correct on {', '.join(map(str, world_sizes))} ranks, every rank "
            "reached within ceil(log2 K) rounds")


# --- lesson 02: gradient averaging and bucketing ---

def _hook_model() -> torch.nn.Module:
    from .models import mlp

    return mlp([5, 7, 3], seed=11, dtype=torch.float64)


def _hook_batch() -> torch.Tensor:
    return torch.randn(12, 5, generator=torch.Generator().manual_seed(12), dtype=torch.float64)


def _run_hook(hook: Callable) -> list[list[float]]:
    from .data_parallel import shard

    model = _hook_model()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    local = shard(_hook_batch())
    (model(local) ** 2).mean().backward()
    return [p.grad.reshape(-1).tolist() for p in model.parameters()]


def check_gradient_hook(average_gradient_hook: Callable, world_size: int = 4) -> str:
    """Register `average_gradient_hook(param)` on every parameter of a model on real ranks
    (12 samples, 3 per rank) and compare every gradient with one process's."""
    got = _run_on_ranks("average_gradient_hook", _run_hook, world_size, average_gradient_hook)
    model = _hook_model()
    (model(_hook_batch()) ** 2).mean().backward()
    names = [name for name, _ in model.named_parameters()]
    for index, p in enumerate(model.parameters()):
        want = p.grad.reshape(-1)
        for rank, grads in enumerate(got):
            mine = torch.tensor(grads[index], dtype=torch.float64)
            if torch.allclose(mine, want, rtol=1e-10, atol=1e-12):
                continue
            hint = ""
            if torch.allclose(mine, want * world_size, rtol=1e-10, atol=1e-12):
                hint = (f" It is {world_size}x too large: you summed the ranks' gradients; "
                        "divide by the world size to average them.")
            elif rank == 0 and not torch.allclose(
                    torch.tensor(got[1][index], dtype=torch.float64), mine):
                hint = " Ranks disagree: the gradient was not all-reduced."
            raise ExerciseError(f"average_gradient_hook: rank {rank}, parameter '{names[index]}' "
                                f"has gradient {mine[:3].tolist()}..., expected "
                                f"{want[:3].tolist()}... (one process, whole batch).{hint}")
    return (f"average_gradient_hook: every gradient on all {world_size} ranks equals "
            "one process's")


def _run_bucketed(fn: Callable, sizes: list[int], bucket_bytes: int) -> tuple:
    import minipar

    from . import collectives

    grads = [torch.full((n,), float(minipar.rank() + 1) * (i + 1), dtype=torch.float32)
             for i, n in enumerate(sizes)]
    calls = []
    original = collectives.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    collectives.all_reduce = counted
    try:
        fn(grads, bucket_bytes)
    finally:
        collectives.all_reduce = original
    return [g.tolist() for g in grads], calls


def _reference_buckets(sizes: list[int], bucket_bytes: int) -> list[int]:
    """Elements per bucket: tensors in order, a new bucket when the next would overflow."""
    buckets: list[int] = []
    used = 0
    for n in sizes:
        if not buckets or used + 4 * n > bucket_bytes:
            buckets.append(0)
            used = 0
        buckets[-1] += n
        used += 4 * n
    return buckets


def check_bucketing(bucketed_all_reduce: Callable, world_size: int = 2) -> str:
    """Run `bucketed_all_reduce(grads, bucket_bytes)` on real ranks for several layouts;
    check every averaged value and that each bucket took exactly one all-reduce."""
    cases = [([4, 4, 4, 4], 32), ([10, 1, 1, 10], 48), ([3, 50, 2], 40), ([5, 5], 1 << 20)]
    for sizes, bucket_bytes in cases:
        results = _run_on_ranks("bucketed_all_reduce", _run_bucketed, world_size,
                                bucketed_all_reduce, sizes, bucket_bytes)
        mean_rank = sum(r + 1 for r in range(world_size)) / world_size
        for rank, (grads, _) in enumerate(results):
            for i, values in enumerate(grads):
                want = mean_rank * (i + 1)
                if any(abs(v - want) > 1e-6 for v in values):
                    raise ExerciseError(
                        f"bucketed_all_reduce(sizes={sizes}, bucket_bytes={bucket_bytes}): rank "
                        f"{rank}, tensor {i} holds {values[:3]}..., expected {want:g} everywhere "
                        "(the average over ranks). Did you copy the bucket back into each "
                        "tensor after the all-reduce?")
        expected = _reference_buckets(sizes, bucket_bytes)
        calls = results[0][1]
        if calls != expected:
            why = ""
            if len(calls) == len(sizes) and len(expected) != len(sizes):
                why = " One all-reduce per tensor is not bucketing: pack tensors together."
            elif len(calls) == 1 and len(expected) > 1:
                why = " Everything went in one all-reduce: respect bucket_bytes."
            raise ExerciseError(
                f"bucketed_all_reduce(sizes={sizes}, bucket_bytes={bucket_bytes}) made "
                f"all-reduces of {calls} elements; expected {expected} (fill buckets in order "
                f"with float32 = 4 bytes, start a new one when the next tensor would not fit)."
                + why)
    return (f"bucketed_all_reduce: right values and one all-reduce per bucket in {len(cases)} "
            "layouts")


# --- lesson 03: a 1F1B generator and a stage's forward step ---

def check_one_f_one_b(one_f_one_b: Callable,
                      cases: tuple[tuple[int, int], ...] = ((2, 4), (4, 8), (4, 4), (3, 7), (4, 2))
                      ) -> str:
    """`one_f_one_b(p, m)` returns each rank's compute order (lists of Action F/B). Wrapped
    with sends and receives, it must validate, have GPipe's bubble (p-1)/(m+p-1) with B=2F,
    and hold at most p - rank micro-batches on rank r (fewer if m < p)."""
    from .pipeline import Schedule, peak_in_flight, simulate, validate
    from .pipeline.schedules import _with_communication

    for p, m in cases:
        where = f"one_f_one_b(p={p}, m={m})"
        try:
            orders = one_f_one_b(p, m)
        except NotImplementedError:
            raise ExerciseError(f"{where}: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        if not isinstance(orders, list) or len(orders) != p:
            raise ExerciseError(f"{where}: return a list with one list of actions per rank "
                                f"({p} lists)")
        plan = Schedule("1f1b (yours)", p, m, 1)
        try:
            plan.actions = _with_communication(plan, orders)
            validate(plan)
        except ValueError as err:
            raise ExerciseError(f"{where}: {err}") from None
        bubble = simulate(plan, {"F": 1.0, "B": 2.0}).summary(p).bubble_fraction
        if abs(bubble - (p - 1) / (m + p - 1)) > 1e-9:
            raise ExerciseError(f"{where}: bubble {bubble:.4f}, but 1F1B's is (p-1)/(m+p-1) = "
                                f"{(p - 1) / (m + p - 1):.4f}; the warm-up on rank r is "
                                "p-1-r forwards, then one forward and one backward in turn")
        for r, peak in enumerate(peak_in_flight(plan)):
            if peak > min(p - r, m):
                raise ExerciseError(
                    f"{where}: rank {r} holds {peak} micro-batches' activations at once; 1F1B "
                    f"holds at most p - rank = {min(p - r, m)} (GPipe would hold all {m}). "
                    f"Rank {r}'s order: {' '.join(map(str, orders[r]))}")
    return f"one_f_one_b: valid, GPipe's bubble with 1F1B's memory on {len(cases)} shapes"


def _stage_layers(k: int) -> list[torch.nn.Module]:
    torch.manual_seed(21)
    return [torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Tanh())
            for _ in range(k)]


def _stage_batch() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(22), dtype=torch.float64)


def _call_stage(fn: Callable) -> list[float]:
    import minipar

    me = minipar.rank()
    module = _stage_layers(minipar.world_size())[me]
    x = _stage_batch() if me == 0 else None
    with torch.no_grad():
        out = fn(module, x)
    return out.reshape(-1).tolist()


def check_stage_forward(stage_forward: Callable, world_size: int = 3) -> str:
    """Run `stage_forward(module, x)` on real ranks: rank 0 gets the batch, the others None
    and must receive their input (shape (3, 4), float64) from the rank before; each returns
    its stage's output after sending it on. Every rank's output is checked."""
    got = _run_on_ranks("stage_forward", _call_stage, world_size, stage_forward, timeout=15)
    x = _stage_batch()
    with torch.no_grad():
        for r, layer in enumerate(_stage_layers(world_size)):
            x = layer(x)
            mine = torch.tensor(got[r], dtype=torch.float64)
            if mine.shape != x.reshape(-1).shape or not torch.allclose(mine, x.reshape(-1)):
                raise ExerciseError(
                    f"stage_forward: rank {r} returned {got[r][:3]}..., expected "
                    f"{x.reshape(-1)[:3].tolist()}... (stage {r}'s output). "
                    + ("Rank 0 computes on the batch it is given." if r == 0 else
                       f"Rank {r} must receive rank {r - 1}'s output, then apply its module."))
    return f"stage_forward: every stage's output right on {world_size} ranks"


# --- lesson 04: the g operator and a row-parallel linear layer ---

def _call_g(g_class: type) -> tuple[list[float], list[float]]:
    import minipar

    x = (torch.arange(4, dtype=torch.float64) + 1) * (minipar.rank() + 1)
    x.requires_grad_(True)
    y = g_class.apply(x)
    upstream = torch.arange(4, dtype=torch.float64) + 10 * (minipar.rank() + 1)
    y.backward(upstream)
    return y.detach().tolist(), x.grad.tolist()


def check_g_operator(g_class: type, world_size: int = 2) -> str:
    """`g_class.apply(x)` must all-reduce (sum) x forward and pass the gradient through
    unchanged backward, on every rank."""
    got = _run_on_ranks("g_operator", _call_g, world_size, g_class)
    total = sum((torch.arange(4, dtype=torch.float64) + 1) * (r + 1) for r in range(world_size))
    for r, (out, grad) in enumerate(got):
        upstream = torch.arange(4, dtype=torch.float64) + 10 * (r + 1)
        if not torch.allclose(torch.tensor(out, dtype=torch.float64), total):
            raise ExerciseError(f"g_operator forward on rank {r} gave {out}, expected "
                                f"{total.tolist()}: g sums the ranks' partial results "
                                "(all-reduce) in the forward pass")
        if not torch.allclose(torch.tensor(grad, dtype=torch.float64), upstream):
            hint = " (that is an all-reduce: g's backward is the identity; f's is the " \
                   "all-reduce)" if torch.allclose(
                torch.tensor(grad, dtype=torch.float64),
                sum(torch.arange(4, dtype=torch.float64) + 10 * (q + 1)
                    for q in range(world_size))) else ""
            raise ExerciseError(f"g_operator backward on rank {r} gave {grad}, expected the "
                                f"incoming gradient {upstream.tolist()} unchanged{hint}")
    return f"g_operator: all-reduce forward, identity backward on {world_size} ranks"


def _call_row(fn: Callable) -> tuple:
    import minipar

    torch.manual_seed(31)
    twin = torch.nn.Linear(8, 3, dtype=torch.float64)
    k, me = minipar.world_size(), minipar.rank()
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(32))
    x_local = x.chunk(k, dim=-1)[me].clone().requires_grad_(True)
    weight = twin.weight.detach().chunk(k, dim=1)[me].clone().requires_grad_(True)
    bias = twin.bias.detach().clone().requires_grad_(True)
    y = fn(x_local, weight, bias)
    y.sin().sum().backward()
    return (y.detach(), x_local.grad, weight.grad, bias.grad)


def check_row_parallel_linear(row_parallel_linear: Callable,
                              world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`row_parallel_linear(x_local, weight_local, bias)`: x's columns and the weight's
    columns are this rank's slices; the result must be the full layer's output on every
    rank, and every gradient must match the single-process layer's (sliced)."""
    torch.manual_seed(31)
    twin = torch.nn.Linear(8, 3, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(32))
    x.requires_grad_(True)
    y = twin(x)
    y.sin().sum().backward()
    for k in world_sizes:
        got = _run_on_ranks("row_parallel_linear", _call_row, k, row_parallel_linear)
        for r, (out, gx, gw, gb) in enumerate(got):
            where = f"row_parallel_linear on {k} ranks, rank {r}"
            if not torch.allclose(out, y.detach()):
                partial = out.shape == y.shape and not torch.allclose(out, y.detach())
                raise ExerciseError(f"{where}: output differs from the full layer's." + (
                    " Each rank's product is only a partial sum: all-reduce it (g) and add "
                    "the bias once, after the reduction." if partial else ""))
            checks = (("x_local", gx, x.grad.chunk(k, dim=-1)[r]),
                      ("weight_local", gw, twin.weight.grad.chunk(k, dim=1)[r]),
                      ("bias", gb, twin.bias.grad))
            for name, mine, want in checks:
                if mine is None or not torch.allclose(mine, want):
                    raise ExerciseError(f"{where}: the gradient of {name} is wrong. Use an "
                                        "operator whose backward passes the gradient through "
                                        "unchanged (g), so autograd does the rest.")
    return (f"row_parallel_linear: output and every gradient match on "
            f"{', '.join(map(str, world_sizes))} ranks")


# --- lesson 05: top-k routing with capacity, and all-to-all dispatch ---

_ROUTING_CASES = [
    (torch.tensor([[4.0, 3, 0, 0], [4.0, 0, 3, 0], [4.0, 3, 0, 0], [0.0, 4, 3, 0]]), 2, 2),
    (torch.tensor([[5.0, 0, 1]] * 6), 1, 2),
    (torch.randn(10, 4, generator=torch.Generator().manual_seed(41)), 2, 3),
    (torch.randn(9, 3, generator=torch.Generator().manual_seed(42)), 3, 4),
]


def check_topk_routing(top_k_routing: Callable) -> str:
    """`top_k_routing(logits, k, capacity)` -> (expert [T, k], slot [T, k], -1 = dropped),
    with minipar's convention: choices ranked by logit, slots given to every token's first
    choice in token order, then every second choice, ..., full experts drop the choice."""
    from .moe import route

    for logits, k, cap in _ROUTING_CASES:
        tokens, experts = logits.shape
        want = route(logits, k, capacity_factor=cap * experts / (k * tokens))
        assert want.capacity == cap
        try:
            expert, slot = top_k_routing(logits, k, cap)
        except NotImplementedError:
            raise ExerciseError("top_k_routing: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        expert, slot = torch.as_tensor(expert), torch.as_tensor(slot)
        if expert.shape != (tokens, k) or slot.shape != (tokens, k):
            raise ExerciseError(f"top_k_routing: return two [tokens, k] = [{tokens}, {k}] "
                                f"tensors; got {tuple(expert.shape)} and {tuple(slot.shape)}")
        for t in range(tokens):
            for j in range(k):
                e, s = int(expert[t, j]), int(slot[t, j])
                we, ws = int(want.expert[t, j]), int(want.slot[t, j])
                if (e, s) != (we, ws):
                    why = ("choice j must be the expert with the (j+1)-th largest logit"
                           if e != we else
                           "slots go to every token's first choice (in token order) before "
                           "any second choice; a choice that finds its expert full gets -1")
                    raise ExerciseError(
                        f"top_k_routing(k={k}, capacity={cap}): token {t}, choice {j + 1}: you "
                        f"gave expert {e} slot {s}, expected expert {we} slot {ws} ({why})")
    return f"top_k_routing: every (token, choice) right in {len(_ROUTING_CASES)} cases"


def _call_dispatch(fn: Callable, experts_per_rank: int) -> tuple:
    import minipar

    me, k = minipar.rank(), minipar.world_size()
    gen = torch.Generator().manual_seed(50 + me)
    expert = torch.randint(0, experts_per_rank * k, (7,), generator=gen)
    x = torch.arange(7, dtype=torch.float64)[:, None] + 100 * me + torch.zeros(7, 3)
    got = fn(x, expert, experts_per_rank)
    return got, expert


def check_dispatch(dispatch_to_owners: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> str:
    """`dispatch_to_owners(x, expert, experts_per_rank)` sends row i of x to the rank that
    owns expert[i] (rank = expert // experts_per_rank) with collectives.all_to_all and
    returns the rows this rank received: grouped by source rank, in each source's row order."""
    for k in world_sizes:
        results = _run_on_ranks("dispatch_to_owners", _call_dispatch, k, dispatch_to_owners, 2)
        for dst, (got, _) in enumerate(results):
            rows = []
            for src, (_, expert) in enumerate(results):
                for i, e in enumerate(expert.tolist()):
                    if e // 2 == dst:
                        rows.append(torch.full((3,), float(i + 100 * src), dtype=torch.float64))
            want = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)
            if got.shape != want.shape or not torch.equal(got, want):
                ids = [int(v) for v in got[:, 0].tolist()] if got.dim() == 2 else got.tolist()
                raise ExerciseError(
                    f"dispatch_to_owners on {k} ranks: rank {dst} received rows "
                    f"{ids} (value = 100 x source rank + row), expected "
                    f"{[int(v) for v in want[:, 0].tolist()]}. Sort rows by destination rank "
                    "(stably), and pass send_counts = rows per destination.")
    return f"dispatch_to_owners: every rank received exactly its rows on {world_sizes} ranks"


# --- learners' copies ---

def strip_solutions(source: str, cell_label: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION block with a stub naming its exercise."""
    lines, out, inside = source.split("\n"), [], False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError(f"{cell_label}: {BEGIN} inside another solution block")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            name = _exercise_name(lines[:i], indent) or cell_label
            out.append(f'{indent}raise NotImplementedError("exercise {name}: '
                       'write your code here")')
        elif stripped.startswith(END):
            if not inside:
                raise ValueError(f"{cell_label}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{cell_label}: {BEGIN} without {END}")
    return "\n".join(out)


def _exercise_name(before: list[str], indent: str) -> str | None:
    """The innermost enclosing `def` above the solution block."""
    for line in reversed(before):
        match = re.match(r"(\s*)def (\w+)", line)
        if match and len(match.group(1)) < len(indent):
            return match.group(2)
    return None


def student_notebook(notebook: dict) -> dict:
    """A learner's copy of a notebook: solutions stubbed, every output cleared."""
    copy = json.loads(json.dumps(notebook))
    for index, cell in enumerate(copy["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if BEGIN in source:
            source = strip_solutions(source, f"cell {index}")
        cell["source"] = source.splitlines(keepends=True)
        cell["outputs"], cell["execution_count"] = [], None
    return copy


def write_student_copies(source_dir: str | Path, dest_dir: str | Path) -> list[Path]:
    """Write a learner's copy of every lesson notebook in `source_dir` into `dest_dir`."""
    source_dir, dest_dir = Path(source_dir), Path(dest_dir)
    notebooks = sorted(source_dir.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise ValueError(f"no lesson notebooks (NN_name.ipynb) in {source_dir}; "
                         "pass --source with the lessons folder of a minipar checkout")
    if dest_dir.resolve() == source_dir.resolve():
        raise ValueError("the student folder must differ from the lessons folder, "
                         "or the solutions would be overwritten")
    dest_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        target = dest_dir / path.name
        copy = student_notebook(json.loads(path.read_text()))
        target.write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written
