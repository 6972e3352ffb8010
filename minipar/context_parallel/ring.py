"""Ring attention: each of K ranks keeps its slice of the queries; the key/value blocks
travel once around the ring, and each rank merges one block's attention per step.

Step s on rank r: attend r's queries to the key/value block that started on rank r-s,
while that block already travels on to r+1 and the next one arrives from r-1 (posted
before the math, so the transfer overlaps it). After K steps every query has seen every
key, and at most two key/value blocks were in flight on a rank at once. Causal attention
skips blocks that lie wholly in a query's future; with the balanced layout
(`attention.positions`) every rank skips as much as every other.

Backward runs the same ring: dq accumulates at home, while each block's dk and dv
accumulate on the block's journey (travelling one step behind it) and arrive home
after the K-th step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from ..runtime import rank, world_size
from ..trace import record
from .attention import block_attention, block_gradients, chunks, fully_masked, merge, positions


@dataclass
class RingWork:
    """What one rank computed: score entries (query x key pairs) in forward and backward,
    and chunk pairs skipped because the causal mask hides them."""

    forward: int = 0
    backward: int = 0
    skipped: int = 0


def ring_plan(world_size: int, causal: bool, balanced: bool) -> list[list[dict]]:
    """What every rank does at every step, on a grid of 2K x 2K cells (the sequence cut
    into 2K equal chunks, queries by keys): plan[step][rank] = {"src": whose key/value
    block it holds, "cells": [(query cell, key cell, computed)]}. A cell is skipped
    (computed False) when its chunk pair lies wholly in the queries' future, exactly as
    `ring_attention` skips it; pure arithmetic, for pictures and for counting work."""
    k = world_size
    if k < 1:
        raise ValueError(f"world_size must be at least 1; got {k}")
    # in 2K-chunk units: balanced rank r holds chunks r and 2K-1-r, contiguous holds 2r, 2r+1
    cells = {r: [r, 2 * k - 1 - r] if balanced else [2 * r, 2 * r + 1] for r in range(k)}

    def groups(r: int) -> list[list[int]]:  # the chunks ring_attention computes as one
        return [[c] for c in cells[r]] if balanced else [cells[r]]

    plan = []
    for step in range(k):
        row = []
        for me in range(k):
            # the block that started on rank me - step: blocks move one hop forward per step
            src = (me - step) % k
            done = []
            for qs in groups(me):
                for ks in groups(src):
                    computed = not (causal and min(ks) > max(qs))
                    done += [(qc, kc, computed) for qc in qs for kc in ks]
            row.append({"src": src, "cells": done})
        plan.append(row)
    return plan


class _Ring:
    """One rank's place in the ring: its neighbours and the layout of every rank's keys."""

    def __init__(self, group, seq_len: int, balanced: bool, causal: bool, overlap: bool):
        self.group, self.k, self.me = group, world_size(group), rank(group)
        self.next, self.prev = (self.me + 1) % self.k, (self.me - 1) % self.k
        self.balanced, self.causal, self.overlap = balanced, causal, overlap
        self.pos = [positions(r, self.k, seq_len, balanced) for r in range(self.k)]

    def pairs(self, src: int, work: RingWork):
        """(query slice, key slice) of the chunk pairs of this rank vs block `src` that the
        mask does not hide wholly."""
        q_pos, k_pos = self.pos[self.me], self.pos[src]
        for qs in chunks(q_pos, self.balanced):
            for ks in chunks(k_pos, self.balanced):
                if fully_masked(q_pos[qs], k_pos[ks], self.causal):
                    work.skipped += 1
                else:
                    yield qs, ks

    def pass_on(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send `tensor` to the next rank and receive the previous rank's into a new buffer;
        returns (buffer, requests to wait on)."""
        # a fresh buffer each time: `tensor` is still being read by the math while it is sent
        incoming = torch.empty_like(tensor)
        # one batch: every rank sends before it receives, which NCCL allows only when the
        # send and the receive progress together
        return incoming, [collectives.post_together([(tensor, self.next)],
                                                    [(incoming, self.prev)], self.group)]


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, work: RingWork):
        out = torch.zeros_like(q)
        # the empty merge: lse -inf with output 0 is the identity of merge()
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # one message per step
        q_pos = ring.pos[ring.me]
        for step in range(ring.k):
            src = (ring.me - step) % ring.k
            last = step == ring.k - 1
            # post the next transfer before the math, so the two overlap; the last block stays put
            if not last and ring.overlap:
                incoming, requests = ring.pass_on(kv)
            with record("compute", f"attend to block {src}", step=step):
                for qs, ks in ring.pairs(src, work):
                    k_pos = ring.pos[src][ks]
                    o, lse_b = block_attention(q[..., qs, :], kv[0][..., ks, :],
                                               kv[1][..., ks, :], q_pos[qs], k_pos, ring.causal)
                    out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o,
                                                          lse_b)
                    work.forward += (qs.stop - qs.start) * (ks.stop - ks.start)
            if not last:
                if not ring.overlap:
                    incoming, requests = ring.pass_on(kv)
                _wait(requests)
                kv = incoming
        # only out and lse per query: backward rebuilds each block's softmax from them
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.work = ring, work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, work = ctx.ring, ctx.work
        dout = dout.contiguous()
        # FlashAttention's D = rowsum(dout * out), once per query, used by every block
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        q_pos = ring.pos[ring.me]
        travelling, grad_requests = None, []  # the dk/dv sum arriving for this step's block
        for step in range(ring.k):
            src = (ring.me - step) % ring.k
            last = step == ring.k - 1
            if not last and ring.overlap:
                incoming, requests = ring.pass_on(kv)
            mine = torch.zeros_like(kv)  # this rank's share of block src's dk, dv
            for qs, ks in ring.pairs(src, work):
                dq_b, dk_b, dv_b = block_gradients(
                    q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], q_pos[qs],
                    ring.pos[src][ks], ring.causal, lse[..., qs], dout[..., qs, :],
                    delta[..., qs])
                dq[..., qs, :] += dq_b
                mine[0][..., ks, :] += dk_b
                mine[1][..., ks, :] += dv_b
                work.backward += (qs.stop - qs.start) * (ks.stop - ks.start)
            # the previous step's dk/dv sum must have arrived before it is added to
            _wait(grad_requests)
            total = mine if travelling is None else travelling + mine
            if ring.k > 1:  # block src's sum moves on, one step behind the block itself
                travelling, grad_requests = ring.pass_on(total.contiguous())
            else:
                travelling = total
            if not last:
                if not ring.overlap:
                    incoming, requests = ring.pass_on(kv)
                _wait(requests)
                kv = incoming
        _wait(grad_requests)  # after K steps, this rank's own block's dk, dv came home
        # None for ring and work: they are not tensors and have no gradient
        return dq, travelling[0], travelling[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   balanced: bool = False, overlap: bool = True, group=None,
                   work: RingWork | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose keys and values
    are split over the ranks of `group` as `attention.positions(rank, K, S, balanced)`
    says. q, k, v: this rank's [..., S/K, D] (float, same shape). `overlap=False` waits for
    each transfer before the next block's math, to measure what overlap saves. `work`
    (a RingWork) counts this rank's score entries and skipped chunk pairs."""
    if q.shape != k.shape or q.shape != v.shape or q.dim() < 2:
        raise ValueError(f"q, k and v must have one shape [..., tokens, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if balanced and not causal:
        raise ValueError("balanced=True only helps causal attention; pass causal=True or "
                         "balanced=False")
    seq_len = q.shape[-2] * world_size(group)
    ring = _Ring(group, seq_len, balanced, causal, overlap)
    return _RingAttention.apply(q, k, v, ring, work if work is not None else RingWork())
