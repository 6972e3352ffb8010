"""Ring attention and Ulysses equal one process: output and every gradient, float64."""

import pytest
import torch

from minipar import collectives
from minipar.context_parallel import (
    RingWork,
    attention,
    block_attention,
    merge,
    positions,
    ring_attention,
    ulysses_attention,
)
from minipar.runtime import rank, world_size

B, H, S, D = 2, 4, 16, 8


def _full(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for _ in range(4)]


def _reference(causal):
    q, k, v, w = _full()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _on_rank(method, causal, balanced, overlap=True):
    k_, me = world_size(), rank()
    pos = positions(me, k_, S, balanced)
    q, k, v, w = _full()
    q, k, v = (t[..., pos, :].clone().requires_grad_() for t in (q, k, v))
    work = RingWork()
    with collectives.meter() as m:
        if method == "ring":
            out = ring_attention(q, k, v, causal, balanced, overlap, work=work)
        else:
            out = ulysses_attention(q, k, v, causal, balanced)
        (out * w[..., pos, :]).sum().backward()
    return pos, out.detach(), q.grad, k.grad, v.grad, work, m.sent_bytes


def test_merging_two_halves_equals_attention_over_both():
    q, k, v, _ = _full()
    pos = torch.arange(S)
    whole, lse = block_attention(q, k, v, pos, pos, causal=True)
    a = block_attention(q, k[..., :5, :], v[..., :5, :], pos, pos[:5], True)
    b = block_attention(q, k[..., 5:, :], v[..., 5:, :], pos, pos[5:], True)
    out, both = merge(*a, *b)
    assert torch.allclose(out, attention(q, k, v, True)) and torch.allclose(out, whole)
    assert torch.allclose(both, lse)
    assert torch.isinf(b[1][..., 0]).all() and (b[0][..., 0, :] == 0).all()  # sees no key


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_attention_equals_attention(causal):
    from minipar.context_parallel import blocked_attention

    q, k, v, w = _full()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    blocked = [t.clone().requires_grad_() for t in (q, k, v)]
    (attention(*full, causal) * w).sum().backward()
    (blocked_attention(*blocked, 4, causal) * w).sum().backward()
    for a, b in zip(full, blocked, strict=True):
        assert torch.allclose(a.grad, b.grad)
    assert torch.allclose(attention(q, k, v, causal), blocked_attention(q, k, v, 3, causal))


@pytest.mark.parametrize("method, causal, balanced, overlap", [
    ("ring", False, False, True), ("ring", True, False, True), ("ring", True, True, True),
    ("ring", True, True, False), ("ulysses", False, False, True), ("ulysses", True, True, True),
])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sequence_parallel_attention_equals_one_process(ranks, method, causal, balanced,
                                                        overlap, cluster4, cluster2):
    if ranks == 1:
        results = [_on_rank(method, causal, balanced, overlap)]
    else:
        cluster = cluster4 if ranks == 4 else cluster2
        results = cluster.run(_on_rank, method, causal, balanced, overlap)
        assert len(results) == ranks
    want = _reference(causal)
    for r, (pos, *got, _work, _bytes) in enumerate(results):
        for name, g, full in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
            assert torch.allclose(g, full[..., pos, :], rtol=1e-10, atol=1e-12), (r, name)


def test_causal_work_is_uneven_contiguous_and_even_balanced(cluster4):
    contiguous = [r[5] for r in cluster4.run(_on_rank, "ring", True, False)]
    balanced = [r[5] for r in cluster4.run(_on_rank, "ring", True, True)]
    c = S // 4
    # rank r sees blocks 0..r: r + 1 blocks of c x c
    assert [w.forward for w in contiguous] == [(r + 1) * c * c for r in range(4)]
    assert len({w.forward for w in balanced}) == 1
    assert max(w.forward for w in balanced) < max(w.forward for w in contiguous) / 1.5
    assert all(w.backward == w.forward for w in contiguous + balanced)


def test_meter_counts_the_ring_and_ulysses_volumes(cluster4):
    k, n = 4, B * H * (S // 4) * D * 8  # one rank's q (or k, v) in bytes
    ring = cluster4.run(_on_rank, "ring", False, False)
    # forward: k and v to the next rank K-1 times; backward: again, plus dk, dv K times
    assert all(r[6] == (k - 1) * 2 * n + (k - 1) * 2 * n + k * 2 * n for r in ring)
    ulysses = cluster4.run(_on_rank, "ulysses", False, False)
    # q, k, v and out forward, their gradients backward: (K-1)/K of each leaves the rank
    assert all(r[6] == 8 * (k - 1) * n // k for r in ulysses)


def test_bad_shapes_get_a_clear_error():
    q = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match="sequence length 6 must be divisible by 2 x ranks = "
                                         "4.*pad it to 8"):
        positions(0, 2, 6, balanced=True)
    with pytest.raises(ValueError, match="balanced=True only helps causal"):
        ring_attention(q, q, q, causal=False, balanced=True)
    with pytest.raises(ValueError, match="must have one shape"):
        ring_attention(q, q[..., :3, :], q)
    with pytest.raises(ValueError, match=r"q must be \[batch, heads, tokens, head_dim\]"):
        ulysses_attention(q[0], q[0], q[0])


def _ulysses_with_3_heads():
    q = torch.zeros(1, 3, 4, 2)
    try:
        ulysses_attention(q, q, q)
    except ValueError as error:
        return str(error)


def test_ulysses_needs_heads_divisible_by_ranks(cluster2):
    assert all("splits the 3 heads over 2 ranks" in e for e in cluster2.run(_ulysses_with_3_heads))


@pytest.mark.parametrize("balanced", [False, True])
def test_ring_plan_counts_the_work_the_ring_does(cluster4, balanced):
    from minipar.context_parallel import ring_plan

    plan = ring_plan(4, causal=True, balanced=balanced)
    cell = (S // 8) ** 2  # the grid cuts the sequence into 2K = 8 chunks
    measured = [r[5].forward for r in cluster4.run(_on_rank, "ring", True, balanced)]
    planned = [sum(cell for step in plan for qc, kc, done in step[r]["cells"] if done)
               for r in range(4)]
    assert planned == measured
    assert [plan[s][1]["src"] for s in range(4)] == [1, 0, 3, 2]
    every = {(qc, kc) for step in plan for row in step for qc, kc, _ in row["cells"]}
    assert len(every) == 64  # every query chunk met every key chunk exactly once


def _grouped(kv_heads):
    """Ulysses with grouped-query attention on this rank: q has H heads, k and v kv_heads
    (each serving H / kv_heads consecutive query heads); against the one-process attention
    of q over the repeated k and v, and the bytes each rank sent."""
    k_, me = world_size(), rank()
    pos = positions(me, k_, S, balanced=True)
    q, k, v, w = _full(3)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    q0, k0, v0 = (t.clone().requires_grad_() for t in (q, k, v))
    group = H // kv_heads
    ref = attention(q0, k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1), True)
    (ref * w).sum().backward()
    q1, k1, v1 = (t[..., pos, :].clone().requires_grad_() for t in (q, k, v))
    with collectives.meter() as m:
        out = ulysses_attention(q1, k1, v1, causal=True, balanced=True)
        (out * w[..., pos, :]).sum().backward()
    gaps = [(a - b[..., pos, :]).abs().max().item() for a, b in
            ((out, ref), (q1.grad, q0.grad), (k1.grad, k0.grad), (v1.grad, v0.grad))]
    return max(gaps), m.sent_bytes


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_ulysses_moves_grouped_kv_heads_and_replicates_them_past_cp(cluster4, kv_heads):
    # 4 ranks: 4 kv heads split one per rank; 2 and 1 are first replicated to 4 (verl#1226)
    one = B * (S // 4) * D * 8  # one head of one rank's slice, float64 bytes
    for gap, sent in cluster4.run(_grouped, kv_heads):
        assert gap < 1e-12, gap
        # q and the output each way, and k and v as 4 heads (after any replication), each
        # all-to-all sending 3/4 of the rank's tensor: the same as without grouping here
        assert sent == 2 * (2 * H * one + 2 * 4 * one) * 3 // 4, sent


def _ulysses_kv_heads_3_on_2():
    q, kv = torch.zeros(1, 6, 4, 2), torch.zeros(1, 3, 4, 2)
    try:
        ulysses_attention(q, kv, kv)
    except ValueError as error:
        return str(error)


def test_ulysses_refuses_kv_heads_that_neither_divide_nor_are_divided(cluster2):
    errors = cluster2.run(_ulysses_kv_heads_3_on_2)
    assert all("3 kv heads over 2 ranks" in e and "\n" not in e for e in errors), errors
