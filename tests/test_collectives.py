"""Every collective against torch.distributed's own, for K in {1, 2, 3, 4, 5, 8}, plus the meter.

Each rank-side function runs all cases for one K and returns a list of failures, so
one launch per K covers every algorithm, op, dtype and edge case.
"""

import math

import pytest
import torch
import torch.distributed as dist
from conftest import value_errors

import minipar
from minipar import collectives as C

SIZES = (0, 1, 3, 7, 64, 1000)  # empty, shorter than K, uneven chunks, several segments below
WORLD_SIZES = (1, 2, 3, 4, 5, 8)
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _data(n, dtype, salt=0):
    """Different on every rank, exact in every dtype (small integers)."""
    r = minipar.rank()
    return ((torch.arange(n) * (r + 3) + salt + 7 * r) % 23 - 5).to(dtype)


def _all_cases():
    failures = []
    K, me = minipar.world_size(), minipar.rank()

    def expect(name, got, want):
        if got is None or want is None:
            if got is not want:
                failures.append(f"{name}: got {got}, want {want}")
        elif got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"{name}: got {got.tolist()}, want {want.tolist()}")

    for dtype in (torch.float32, torch.int64):
        for n in SIZES:
            for op in ("sum", "max", "avg"):
                if op == "avg" and dtype == torch.int64:
                    continue
                want = _data(n, dtype)
                dist.all_reduce(want, op=TORCH_OPS.get(op, dist.ReduceOp.SUM))
                if op == "avg":
                    want /= K
                for algorithm in C.ALL_REDUCE_ALGORITHMS:
                    got = C.all_reduce(_data(n, dtype), op=op, algorithm=algorithm)
                    expect(f"all_reduce {algorithm} {op} {dtype} n={n}", got, want)
            for root in {0, K - 1, K // 2}:
                want = _data(n, dtype, salt=root)
                dist.broadcast(want, src=root)
                for algorithm in C.ROOTED_ALGORITHMS:
                    got = C.broadcast(_data(n, dtype, salt=root), src=root, algorithm=algorithm)
                    expect(f"broadcast {algorithm} src={root} n={n}", got, want)
                    mine = _data(n, dtype)
                    want_r = mine.clone()
                    dist.reduce(want_r, dst=root)
                    got_r = C.reduce(mine.clone(), dst=root, algorithm=algorithm)
                    expect(f"reduce {algorithm} dst={root} n={n}", got_r,
                           want_r if me == root else mine)
                full = _data(n * K, dtype, salt=root)
                chunk = C.scatter(full.clone(), src=root)
                everything = full.clone()
                dist.broadcast(everything, src=root)
                expect(f"scatter src={root} n={n}", chunk, torch.tensor_split(everything, K)[me])
                gathered = C.gather(_data(n, dtype), dst=root)
                pieces = [torch.empty(n, dtype=dtype) for _ in range(K)]
                dist.all_gather(pieces, _data(n, dtype))
                expect(f"gather dst={root} n={n}", gathered,
                       torch.cat(pieces) if me == root else None)
            pieces = [torch.empty(n, dtype=dtype) for _ in range(K)]
            dist.all_gather(pieces, _data(n, dtype))
            expect(f"all_gather n={n}", C.all_gather(_data(n, dtype)), torch.cat(pieces))
            summed = _data(n, dtype)
            dist.all_reduce(summed)
            expect(f"reduce_scatter n={n}", C.reduce_scatter(_data(n, dtype)),
                   torch.tensor_split(summed, K)[me])
    # 2-D tensors: chunks are row blocks
    matrix = _data(5 * 3, torch.float32).reshape(5, 3)
    summed = matrix.clone()
    dist.all_reduce(summed)
    expect("reduce_scatter 2-D", C.reduce_scatter(matrix), torch.tensor_split(summed, K)[me])
    expect("all_reduce 2-D ring", C.all_reduce(matrix.clone()), summed)
    transposed = matrix.t()  # not contiguous: must still be reduced in place
    C.all_reduce(transposed, algorithm="halving_doubling")
    expect("all_reduce non-contiguous", transposed, summed.t())
    return failures


def _all_to_all_cases():
    failures = []
    K, me = minipar.world_size(), minipar.rank()
    for rows_per_peer in ([2] * K, [(me + j) % 3 for j in range(K)]):  # even, then uneven
        rows = sum(rows_per_peer)
        x = (torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * me)
        in_counts = torch.zeros(K, dtype=torch.int64)
        dist.all_to_all_single(in_counts, torch.tensor(rows_per_peer, dtype=torch.int64))
        want = torch.empty(int(in_counts.sum()), 2)
        dist.all_to_all_single(want, x, output_split_sizes=in_counts.tolist(),
                               input_split_sizes=rows_per_peer)
        got = C.all_to_all(x, rows_per_peer)
        if not torch.equal(got, want):
            failures.append(f"all_to_all counts={rows_per_peer}: {got.tolist()} != "
                            f"{want.tolist()}")
    default = C.all_to_all(torch.arange(7.0) + 10 * me)
    want = torch.cat([torch.tensor_split(torch.arange(7.0) + 10 * src, K)[me]
                      for src in range(K)])
    if not torch.equal(default, want):
        failures.append(f"all_to_all default split: {default.tolist()} != {want.tolist()}")
    return failures


@pytest.mark.parametrize("world_size", [pytest.param(k, marks=pytest.mark.slow) if k > 4 else k
                                        for k in WORLD_SIZES])
@pytest.mark.slow  # fresh ranks per world size, every collective against torch's
def test_matches_torch_distributed(world_size):
    results = minipar.launch(lambda: _all_cases() + _all_to_all_cases(), world_size,
                             backend="gloo", timeout=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert failures == [], "\n".join(failures[:20])


def _metered(algorithm, n):
    t = torch.ones(n)
    with C.meter() as m:
        C.all_reduce(t, algorithm=algorithm)
    return m.sent_bytes, m.recv_bytes, m.messages, m.steps


def _metered_broadcast(algorithm, n):
    t = torch.full((n,), float(minipar.rank() == 0))
    with C.meter() as m:
        C.broadcast(t, src=0, algorithm=algorithm)
    return m.sent_bytes, m.recv_bytes, m.messages, m.steps


@pytest.mark.parametrize("K", [2, 3, 4, 5, 8])
def test_meter_shows_the_lecture_figures(K, request):
    n = 4000 * K + 3  # not divisible: chunk rounding
    shared = {2: "cluster2", 4: "cluster4"}
    cluster = request.getfixturevalue(shared[K]) if K in shared else \
        minipar.Cluster(K, backend="gloo", timeout=60)
    try:
        ring = cluster.run(_metered, "ring", n)
        chunk = math.ceil(n / K)
        for sent, _recv, _messages, steps in ring:
            assert steps == 2 * (K - 1)
            assert abs(sent / 4 - 2 * (K - 1) / K * n) <= 2 * (K - 1) * (chunk - n // K)
        # every chunk crosses K-1 links in each phase
        assert sum(r[0] for r in ring) == sum(r[1] for r in ring) == 2 * (K - 1) * n * 4
        naive = cluster.run(_metered, "naive", n)
        root_sent, root_recv = naive[0][0], naive[0][1]
        assert root_recv == root_sent == (K - 1) * n * 4  # (K-1) x N through the root
        assert all(r[0] == r[1] == n * 4 for r in naive[1:])
        rounds = math.ceil(math.log2(K))
        for algorithm in ("tree", "halving_doubling"):
            steps = [r[3] for r in cluster.run(_metered, algorithm, n)]
            assert max(steps) == 2 * rounds, (algorithm, steps)
        # broadcast: the binomial root sends ceil(log2 K) times, a binary tree's nodes twice
        tree = cluster.run(_metered_broadcast, "tree", n)
        binary = cluster.run(_metered_broadcast, "binary", n)
        assert tree[0][0] == rounds * n * 4
        assert max(r[0] for r in binary) == min(2, K - 1) * n * 4
        assert max(r[3] for r in binary) == (1 if K <= 3 else 2)  # from a parent, to children
        assert sum(r[0] for r in tree) == sum(r[0] for r in binary) == (K - 1) * n * 4
        hd = cluster.run(_metered, "halving_doubling", n)
        if K & (K - 1) == 0:  # power of two: the ring's volume in log steps
            assert all(abs(r[0] - ring[i][0]) <= 4 * K for i, r in enumerate(hd))
    finally:
        if K not in shared:
            cluster.close()


def _bad_calls():
    messages = []
    t = torch.ones(4)
    for call in (lambda: C.all_reduce(t, op="min"), lambda: C.all_reduce(t, algorithm="star"),
                 lambda: C.broadcast(t, src=minipar.world_size()),
                 lambda: C.reduce(t, dst=-1), lambda: C.all_reduce(torch.ones(3, dtype=torch.int32),
                                                                   op="avg"),
                 lambda: C.broadcast(t, algorithm="ring"),
                 lambda: C.all_to_all(t, send_counts=[1, 1])):
        try:
            with C.meter() as m:
                call()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
            if m.messages:
                messages.append("sent before refusing")
    return messages


def test_bad_arguments_fail_on_every_rank_before_any_message(cluster2):
    results = cluster2.run(_bad_calls)
    assert results[0] == results[1]
    words = ["op must be one of 'sum', 'avg', 'max'", "algorithm must be one of",
             "src must be a rank in 0..1", "dst must be a rank in 0..1",
             "op='avg' needs a floating-point tensor", "algorithm must be one of 'naive', 'tree'",
             "send_counts must be 2 non-negative ints"]
    assert len(results[0]) == len(words)
    for message, expected in zip(results[0], words, strict=True):
        assert expected in message


def test_mismatched_shapes_raise_on_every_rank_instead_of_hanging(cluster2):
    def mismatched():
        try:
            C.all_reduce(torch.ones(3 + minipar.rank()))
        except ValueError as err:
            return str(err)

    messages = cluster2.run(mismatched)
    assert messages[0] == messages[1]
    assert "rank 0 has (3,), rank 1 has (4,)" in messages[0]


def test_transfers_are_events_with_peer_bytes_chunk_and_step(cluster4):
    def ring_once():
        C.all_reduce(torch.ones(8))

    timeline = cluster4.run(ring_once).timeline
    sends = [e for e in timeline if e.kind == "send" and e.rank == 1]
    assert [e.step for e in sends] == list(range(6))
    assert all(e.peer == 2 and e.bytes == 8 and "chunk" in e.args for e in sends)
    assert [e.args["chunk"] for e in sends] == [0, 3, 2, 1, 0, 3]


def test_segments_overlap_reduction_and_still_match(cluster2, monkeypatch):
    def small_segments():
        from minipar.collectives import comm

        comm.SEGMENT_BYTES = 64  # 16 floats a segment: many segments per chunk
        t = torch.arange(1000, dtype=torch.float32) * (minipar.rank() + 1)
        with C.meter() as m:
            C.all_reduce(t)
        comm.SEGMENT_BYTES = 1 << 20
        return torch.equal(t, torch.arange(1000, dtype=torch.float32) * 3), m.messages, m.steps

    for same, messages, steps in cluster2.run(small_segments):
        assert same and steps == 2 and messages == 2 * math.ceil(500 / 16)


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_cost_model_predicts_the_metered_bytes(K, request):
    from minipar import cost

    n = 840  # divisible by every chunk count used for K <= 8: no rounding
    shared = {2: "cluster2", 4: "cluster4"}
    cluster = request.getfixturevalue(shared[K]) if K in shared else \
        minipar.Cluster(K, backend="gloo", timeout=60)
    try:
        for algorithm in C.ALL_REDUCE_ALGORITHMS:
            metered = cluster.run(_metered, algorithm, n)
            model = cost.all_reduce_cost(algorithm, K, n * 4)
            assert sum(r[0] for r in metered) == model.total_bytes, algorithm
            assert max(r[0] for r in metered) == model.busiest_rank_bytes, algorithm
            assert max(r[3] for r in metered) == model.steps, algorithm
    finally:
        if K not in shared:
            cluster.close()


def test_isend_matches_a_plain_recv_across_segments(cluster2):
    def exchange_big():
        n = (3 << 20) // 4 + 5  # 3 MiB and a bit: four segments of different sizes
        if minipar.rank() == 0:
            pending = C.isend(torch.arange(n, dtype=torch.float32), 1)
            with C.meter() as m:
                pending.wait()
            return m.sent_bytes
        got = C.recv(torch.empty(n), 0)
        return bool(torch.equal(got, torch.arange(n, dtype=torch.float32)))

    sent, same = cluster2.run(exchange_big)
    assert same and sent == ((3 << 20) // 4 + 5) * 4


def test_all_to_all_with_known_counts_skips_the_count_exchange_and_checks_them(cluster2):
    def run():
        me = minipar.rank()
        x = torch.arange(6.0).reshape(3, 2) + 10 * me
        send = [1, 2] if me == 0 else [2, 1]
        recv = C.swap_counts(send)
        with C.meter() as m:
            got = C.all_to_all(x, send, recv)
        wrong = value_errors(lambda: C.all_to_all(x, send, recv[::-1]))[0]
        return recv, got, {t.phase for t in m.transfers}, wrong

    (recv0, got0, phases, wrong), (recv1, got1, _, _) = cluster2.run(run)
    assert recv0 == [1, 2] and recv1 == [2, 1]
    assert got0.tolist() == [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]]
    assert got1.tolist() == [[2.0, 3.0], [4.0, 5.0], [14.0, 15.0]]
    assert phases == {"exchange"}  # no "counts" phase: both sizes were known
    assert "rank 0 expects [2, 1] rows from ranks 0..1 but they send [1, 2]" in wrong


def test_comm_thread_runs_jobs_in_order_and_join_raises_a_failure():
    from minipar.collectives.background import CommThread

    comm, seen = CommThread(), []
    for i in range(5):
        comm.submit(seen.append, i)
    failed = comm.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        comm.join()
    assert seen == [0, 1, 2, 3, 4] and isinstance(failed.exception(), ZeroDivisionError)
    comm.join()  # reported once


def _pipelined_ring_cases():
    """The pipelined ring against torch's all_reduce: sizes with empty chunks, one segment
    and several (uneven last segment), sum / avg / max; and the same bytes as the ring."""
    failures = []
    me = minipar.rank()
    segment = C.SEGMENT_BYTES // 4
    for n in (1, 3, 1000, 2 * segment * minipar.world_size() + 777):
        for op in ("sum", "avg", "max"):
            mine = _data(n, torch.float32, salt=7) * (me + 1)
            want = mine.clone()
            dist.all_reduce(want, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "avg":
                want /= minipar.world_size()
            got = C.pipelined_ring_all_reduce(mine.clone(), op=op)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                failures.append(f"pipelined ring n={n} op={op}: max error "
                                f"{(got - want).abs().max().item():.3g}")
    t = torch.ones(4000 * minipar.world_size() + 3)
    with C.meter() as piped:
        C.pipelined_ring_all_reduce(t.clone())
    with C.meter() as ring:
        C.all_reduce(t.clone(), algorithm="ring")
    if (piped.sent_bytes, piped.recv_bytes, piped.steps) != \
            (ring.sent_bytes, ring.recv_bytes, ring.steps):
        failures.append(f"pipelined ring meter {piped.sent_bytes, piped.recv_bytes, piped.steps}"
                        f" != ring's {ring.sent_bytes, ring.recv_bytes, ring.steps}")
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pipelined_ring_matches_torch(world_size, request):
    shared = {2: "cluster2", 4: "cluster4"}
    if world_size in shared:
        results = request.getfixturevalue(shared[world_size]).run(_pipelined_ring_cases)
    else:
        results = minipar.launch(_pipelined_ring_cases, world_size, backend="gloo", timeout=60)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert failures == [], "\n".join(failures[:20])


def _two_threads_at_once() -> int:
    """A thread all-reduces over dp while the main thread all-reduces over tp (as DDP's
    communication thread runs beside tensor parallelism's backward): wrong entries seen."""
    import threading

    from minipar.mesh import Mesh

    mesh = Mesh(dp=2, tp=2)
    groups, me, wrong = mesh.connect(), minipar.rank(), []

    def reduce_many(name: str) -> None:
        expected = sum(r + 1 for r in mesh.group_of(name, me))
        for i in range(60):
            t = torch.full((3000 + i,), float(me + 1), dtype=torch.float64)
            C.all_reduce(t, group=getattr(groups, name))
            wrong.append(int((t != expected).sum()))

    other = threading.Thread(target=reduce_many, args=("dp",))
    other.start()
    reduce_many("tp")
    other.join()
    return sum(wrong)


def test_collectives_on_two_threads_at_once_stay_exact(cluster4):
    assert cluster4.run(_two_threads_at_once) == [0, 0, 0, 0]
