"""Lesson 08's exercise checks: the online-softmax merge, and one step of the ring."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..grading import ExerciseError, refuse_library, run_on_ranks
from ..runtime import device, rank, world_size
from .attention import attention, block_attention, positions

_B, _H, _S, _D = 1, 2, 12, 4


def _merge_cases() -> list[tuple[str, torch.Tensor, ...]]:
    """(what the case tests, q, k, v, where the keys split): every split must give the
    attention over all keys."""
    gen = torch.Generator().manual_seed(80)
    q, k, v = (torch.randn(_B, _H, 6, _D, generator=gen, dtype=torch.float64)
               for _ in range(3))
    return [("an even split", q, k, v, 3, False),
            ("an uneven split", q, k, v, 1, False),
            ("large scores (exp overflows unless you subtract the larger lse)", 1000 * q, k, v,
             3, False),
            ("a causal split, where early queries see no key of the second block", q, k, v,
             2, True)]


def check_merge(merge_partial: Callable) -> str:
    """`merge_partial(out_a, lse_a, out_b, lse_b)` -> (out, lse): two partial attention
    results over disjoint key blocks merged into the result over both."""
    refuse_library("merge_partial", merge_partial)
    for what, q, k, v, cut, causal in _merge_cases():
        pos = torch.arange(q.shape[-2])
        a = block_attention(q, k[..., :cut, :], v[..., :cut, :], pos, pos[:cut], causal)
        b = block_attention(q, k[..., cut:, :], v[..., cut:, :], pos, pos[cut:], causal)
        want_out, want_lse = block_attention(q, k, v, pos, pos, causal)
        try:
            out, lse = merge_partial(*a, *b)
        except NotImplementedError:
            raise ExerciseError("merge_partial: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        out, lse = torch.as_tensor(out), torch.as_tensor(lse)
        if out.shape != want_out.shape or lse.shape != want_lse.shape:
            raise ExerciseError(f"merge_partial ({what}): return out {tuple(want_out.shape)} "
                                f"and lse {tuple(want_lse.shape)}; got {tuple(out.shape)} and "
                                f"{tuple(lse.shape)}")
        if not torch.isfinite(out).all():
            raise ExerciseError(
                f"merge_partial ({what}): your output has inf or nan. exp(lse) overflows for "
                "large scores and exp(-inf - -inf) is nan: weigh each part by "
                "exp(lse_part - lse) with lse = torch.logaddexp(lse_a, lse_b), and treat a "
                "part whose lse is -inf (it saw no key) as weight 0.")
        if not torch.allclose(lse, want_lse):
            raise ExerciseError(f"merge_partial ({what}): lse is wrong; the merged "
                                "log-sum-exp is log(exp(lse_a) + exp(lse_b)) = "
                                "torch.logaddexp(lse_a, lse_b).")
        if not torch.allclose(out, want_out):
            raise ExerciseError(
                f"merge_partial ({what}): the output differs from attention over all keys. "
                "Each part is normalised by its own softmax; rescale it to the joint one: "
                "out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).")
    return f"merge_partial: equal to attention over all keys in {len(_merge_cases())} cases"


def _blocks(k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The whole q, and every rank's [2, B, H, S/K, D] key/value block."""
    gen = torch.Generator().manual_seed(81)
    # a CPU generator draws on the host: moved just below
    q, keys, values = (torch.randn(_B, _H, _S, _D, generator=gen, dtype=torch.float64
                                   ).to(device()) for _ in range(3))
    return q, [torch.stack([keys, values])[..., positions(r, k, _S, False), :]
               for r in range(k)]


def _run_ring(fn: Callable) -> tuple[torch.Tensor, list[int | None]]:
    """On one rank: K steps of the learner's ring_step; which block it held after each."""
    k, me = world_size(), rank()
    q_all, blocks = _blocks(k)
    q = q_all[..., positions(me, k, _S, False), :]
    # a copy: the learner may write into kv in place, and `blocks` must stay as drawn
    kv = blocks[me].clone()
    out = torch.zeros_like(q)
    # -inf: the log-sum-exp over no keys yet, the starting point of the online softmax
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    held = []
    for _ in range(k):
        out, lse, kv = fn(q, kv, out, lse)
        kv = torch.as_tensor(kv)
        held.append(next((r for r, b in enumerate(blocks)
                          if b.shape == kv.shape and torch.equal(b, kv)), None))
    return torch.as_tensor(out), held


def check_ring_step(ring_step: Callable, world_sizes: tuple[int, ...] = (2, 4),
                    timeout: float = 30) -> str:
    """`ring_step(q, kv, out, lse)` on every rank: attend q to the block kv ([2, ...]: keys,
    values), merge into (out, lse), pass kv to the next rank and receive the previous
    rank's; return (out, lse, received block). Run K times, every query must have seen
    every key."""
    refuse_library("ring_step", ring_step)
    for k in world_sizes:
        got = run_on_ranks("ring_step", _run_ring, k, ring_step, timeout=timeout)
        q_all, blocks = _blocks(k)
        keys, values = (torch.cat([b[i] for b in blocks], dim=-2) for i in (0, 1))
        for r, (out, held) in enumerate(got):
            for step, block in enumerate(held):
                # after step s, rank r holds the block that started s + 1 ranks to its left
                want = (r - step - 1) % k
                if block == want:
                    continue
                if block is None:
                    why = "a block that is no rank's keys and values: return what you received"
                elif block == (r - step) % k:
                    why = "the block it already had: return the one received from rank r-1"
                else:
                    why = (f"rank {block}'s block: send to rank r+1 and receive from rank "
                           "r-1, so blocks travel one way round the ring")
                raise ExerciseError(f"ring_step on {k} ranks: after step {step}, rank {r} holds "
                                    f"{why} (expected rank {want}'s).")
            want = attention(q_all, keys, values)[..., positions(r, k, _S, False), :]
            if out.shape != want.shape or not torch.allclose(out, want):
                raise ExerciseError(
                    f"ring_step on {k} ranks: rank {r}'s output after {k} steps differs from "
                    "attention over the whole sequence. Merge each block's "
                    "block_attention(...) result into (out, lse) with merge(...), do not "
                    "replace it.")
    return f"ring_step: every block went round and every rank's output is right on {world_sizes}"
