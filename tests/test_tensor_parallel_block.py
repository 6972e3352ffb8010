"""The decoder's tensor- (and sequence-) parallel block equals its single-process twin:
output, input gradient and every parameter's gradient slice (float64), on tp = 2 and 4,
with grouped-query heads split by kv head; SDPA and the explicit softmax agree inside it;
a tp that does not divide kv_heads is refused in one line."""

import pytest
import torch
from conftest import value_errors

import minipar
from minipar import collectives, cost
from minipar import tensor_parallel as tp
from minipar.decoder import Attention, DecoderBlock, DecoderConfig, rope_tables
from minipar.pipeline.stage import SavedActivationMeter

B, S, FFN = 2, 8, 32
# tp -> (heads, kv_heads, hidden): two query heads per kv head, one kv head per rank
SHAPES = {2: (4, 2, 16), 4: (8, 4, 32)}
TOL = dict(rtol=1e-10, atol=1e-12)


def _twin_and_inputs():
    heads, kv_heads, hidden = SHAPES[minipar.world_size()]
    config = DecoderConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=FFN,
                           seq_len=S)
    torch.manual_seed(0)  # nn.Linear's default init: larger weights than Decoder.init's 0.02
    twin = DecoderBlock(config, torch.float64)
    with torch.no_grad():  # norms away from 1, so a wrong norm gradient shows
        for norm in (twin.attn_norm, twin.mlp_norm):
            norm.weight.uniform_(0.5, 1.5)
    cos, sin = rope_tables(config.head_dim, torch.arange(S), config.rope_base, torch.float64)
    x = torch.randn(B, S, hidden, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    return twin, x, cos, sin


def _mine(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.chunk(minipar.world_size(), dim)[minipar.rank()]


def _check_block(sequence_parallel: bool, explicit: bool):
    """(problems, forward collective calls, backward collective calls) on this rank."""
    twin, x, cos, sin = _twin_and_inputs()
    x_twin = x.clone().requires_grad_(True)
    out = twin(x_twin, cos, sin, explicit)
    out.sin().sum().backward()
    block = tp.ParallelDecoderBlock(twin, sequence_parallel=sequence_parallel)
    # sequence parallel: each rank holds its slice of the sequence, dim 1 of [batch, seq, hidden]
    x_par = (_mine(x, 1) if sequence_parallel else x).clone().requires_grad_(True)
    with collectives.meter() as m:
        y = block(x_par, cos, sin, explicit)
        forward_calls = dict(m.calls)
        y.sin().sum().backward()
    backward_calls = {k: v - forward_calls.get(k, 0) for k, v in m.calls.items()
                      if v - forward_calls.get(k, 0)}
    if sequence_parallel:
        tp.sync_sequence_parallel_grads(block)
    want_out, want_xg = (_mine(out, 1), _mine(x_twin.grad, 1)) if sequence_parallel \
        else (out, x_twin.grad)
    problems = []
    if not torch.allclose(y, want_out, **TOL):
        problems.append("output")
    if not torch.allclose(x_par.grad, want_xg, **TOL):
        problems.append("input grad")
    twin_params = dict(twin.named_parameters())
    for name, p in block.named_parameters():
        ref = twin_params[name].grad
        if p.shape != ref.shape:  # column-parallel: output features (dim 0); row: input (dim 1)
            ref = _mine(ref, 0 if p.shape[0] != ref.shape[0] else 1)
        if not torch.allclose(p.grad, ref, **TOL):
            problems.append(name)
    return problems, forward_calls, backward_calls


def _all_checks():
    return {(sp, explicit): _check_block(sp, explicit)
            for sp in (False, True) for explicit in (False, True)}


@pytest.mark.parametrize("size", [2, 4])
def test_block_equals_its_twin_with_and_without_sequence_parallelism(size, cluster2, cluster4):
    cluster = cluster2 if size == 2 else cluster4
    for r, results in enumerate(cluster.run(_all_checks)):
        for (sp, explicit), (problems, fwd, bwd) in results.items():
            assert problems == [], (size, r, sp, explicit, problems)
            # Megatron: per half block one g forward and one f backward; sequence parallel
            # turns each all-reduce into a reduce-scatter and an all-gather
            want = {"all_gather": 2, "reduce_scatter": 2} if sp else {"all_reduce": 2}
            assert fwd == want and bwd == want, (size, r, sp, fwd, bwd)


def _sdpa_and_explicit(sequence_parallel: bool) -> float:
    twin, x, cos, sin = _twin_and_inputs()
    block = tp.ParallelDecoderBlock(twin, sequence_parallel=sequence_parallel)
    x = _mine(x, 1) if sequence_parallel else x
    with torch.no_grad():
        fused, explicit = block(x, cos, sin, explicit=False), block(x, cos, sin, explicit=True)
    return (fused - explicit).abs().max().item()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sdpa_and_explicit_softmax_agree_inside_the_parallel_block(cluster4, sequence_parallel):
    assert max(cluster4.run(_sdpa_and_explicit, sequence_parallel)) < 1e-12


def _refusals():
    return value_errors(lambda: tp.ParallelAttention(Attention(16, 4, 1, dtype=torch.float64)))


def test_kv_heads_that_tp_does_not_divide_are_refused_in_one_line(cluster2):
    (message,) = cluster2.run(_refusals)[0]
    assert "\n" not in message
    for part in ("tp=2", "heads=4", "kv_heads=1", "tp in [1] would work"):
        assert part in message, message


def _saved_per_rank(parallel: bool, sequence_parallel: bool, explicit: bool, hidden=256,
                    heads=4, seq=256):
    """Bytes autograd keeps for one forward of the decoder block (tensor-parallel over the
    ranks, or the whole block) on this rank, in float32."""
    config = DecoderConfig(hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                           seq_len=seq)
    torch.manual_seed(0)
    block = DecoderBlock(config, torch.float32)
    cos, sin = rope_tables(config.head_dim, torch.arange(seq), config.rope_base, torch.float32)
    x = torch.randn(2, seq, hidden)
    if parallel:
        block = tp.ParallelDecoderBlock(block, sequence_parallel=sequence_parallel)
        x = _mine(x, 1) if sequence_parallel else x
    meter = SavedActivationMeter({p.untyped_storage().data_ptr() for p in block.parameters()})
    with meter.recording():
        out = block(x.requires_grad_(True), cos, sin, explicit)
    kept = meter.now  # while `out` holds the graph: what backward would need
    del out
    return kept


@pytest.mark.parametrize("explicit", [False, True], ids=["fused attention", "explicit scores"])
def test_korthikantis_tp_split_matches_the_meter(cluster2, explicit):
    """Korthikanti et al.'s Eq. 2 (tp splits the attention and MLP inner activations, the
    rest stays whole) and its sequence-parallel form (everything splits) against the
    meter, as the share of one process's bytes each tp=2 rank keeps. The decoder is not
    their GPT layer (SwiGLU, RMSNorm, no dropout, float32), so the shares agree to 10%,
    not exactly; the two rules the formula replaced miss by more: no division by tp
    (1.0) without sequence parallelism, and everything divided by tp (0.5) without it.
    With sequence parallelism minipar's column-parallel layers keep their all-gathered
    input whole for backward (Megatron gathers it again instead), which lifts the
    measured share a little above the formula's 1/t."""
    one = cluster2.run(_saved_per_rank, False, False, explicit)[0]  # the whole block
    policy = "none" if explicit else "selective"  # the fused kernel keeps no score matrix
    whole = cost.activation_bytes(1, 256, 256, 2, 4, policy)
    for sp in (False, True):
        measured = max(cluster2.run(_saved_per_rank, True, sp, explicit)) / one
        formula = cost.activation_bytes(1, 256, 256, 2, 4, policy, tp=2,
                                        sequence_parallel=sp) / whole
        assert measured == pytest.approx(formula, rel=0.10), (sp, measured, formula)
        if not sp:  # the old rules would fail here
            assert abs(measured - 1.0) > 0.2 * measured and abs(measured - 0.5) > 0.1 * measured
