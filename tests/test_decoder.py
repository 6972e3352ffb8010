"""The trainer's twin (minipar.decoder): the fused and explicit attention agree, GQA is
multi-head attention with shared keys and values, the model is causal, RoPE sees only
relative positions, the parameter and FLOP counts are exact, the seeded init is
reproducible, and the model learns. Exactness is asserted in float64."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from minipar.decoder import (
    Attention,
    DecoderConfig,
    RMSNorm,
    apply_rope,
    decoder,
    rope_tables,
)
from minipar.generation import KVCache, caching, generate

F64 = torch.float64
SMALL = DecoderConfig(vocab_size=64, layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16)


def _ids(shape: tuple[int, int], vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_heads", [2, 4, 1])
def test_sdpa_equals_the_explicit_softmax(kv_heads):
    config = DecoderConfig(vocab_size=64, layers=2, hidden=32, heads=4, kv_heads=kv_heads,
                           seq_len=16)
    model = decoder(config, dtype=F64)
    ids = _ids((3, 16), 64)
    fused, explicit = model(ids), model(ids, explicit=True)
    torch.testing.assert_close(fused, explicit, atol=1e-12, rtol=0)


def test_gqa_equals_multi_head_attention_with_repeated_kv_weights():
    torch.manual_seed(0)
    hidden, heads, kv_heads = 32, 4, 2
    d, group = hidden // heads, heads // kv_heads
    gqa = Attention(hidden, heads, kv_heads, dtype=F64)
    mha = Attention(hidden, heads, heads, dtype=F64)
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            # kv head j's d rows, repeated for query heads j*group .. j*group + group-1
            rows = getattr(gqa, name).weight.view(kv_heads, d, hidden)
            getattr(mha, name).weight.copy_(rows.repeat_interleave(group, dim=0)
                                            .reshape(heads * d, hidden))
    x = torch.randn(2, 10, hidden, dtype=F64)
    cos, sin = rope_tables(d, torch.arange(10), dtype=F64)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), atol=1e-12, rtol=0)


def test_changing_later_tokens_leaves_earlier_logits_alone():
    model = decoder(SMALL, dtype=F64)
    ids = _ids((2, 16), 64)
    t = 6
    changed = ids.clone()
    changed[:, t + 1:] = _ids((2, 16 - t - 1), 64, seed=1)
    assert not torch.equal(ids, changed)
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_rope_scores_depend_only_on_relative_position():
    d, s = 16, 12
    q, k = torch.randn(2, 1, s, d, dtype=F64), torch.randn(2, 1, s, d, dtype=F64)

    def scores(offset: int) -> torch.Tensor:
        cos, sin = rope_tables(d, torch.arange(s) + offset, dtype=F64)
        return apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2)

    torch.testing.assert_close(scores(0), scores(37), atol=1e-12, rtol=0)
    assert not torch.allclose(scores(0), q @ k.transpose(-1, -2))  # the rotation did act
    # the whole model: positions shifted by a constant give the same logits
    model = decoder(SMALL, dtype=F64)
    ids = _ids((2, 16), 64)
    torch.testing.assert_close(model(ids), model(ids, torch.arange(16) + 100), atol=1e-10,
                               rtol=0)


def test_rope_on_a_slice_with_its_global_positions_equals_the_slice_of_the_whole():
    d, s, start, stop = 8, 20, 7, 13
    x = torch.randn(2, 3, s, d, dtype=F64)
    whole = apply_rope(x, *rope_tables(d, torch.arange(s), dtype=F64))
    part = apply_rope(x[:, :, start:stop], *rope_tables(d, torch.arange(start, stop), dtype=F64))
    torch.testing.assert_close(part, whole[:, :, start:stop], atol=0, rtol=0)


def _unique_numel(model: torch.nn.Module) -> int:
    # every parameter every module holds, then one per object: a tied weight counts once
    held = [p for _, p in model.named_parameters(remove_duplicate=False)]
    return sum(p.numel() for p in {id(p): p for p in held}.values())


def test_tied_head_is_the_embedding_and_counts_once():
    tied = decoder(SMALL)
    assert tied.head.weight is tied.embed.weight
    untied = decoder(DecoderConfig(**{**SMALL.__dict__, "tied": False}))
    assert untied.head.weight is not untied.embed.weight
    extra = SMALL.vocab_size * SMALL.hidden
    assert untied.config.parameters() == SMALL.parameters() + extra


@pytest.mark.parametrize("config", [
    SMALL,
    DecoderConfig(),
    DecoderConfig(vocab_size=50, layers=3, hidden=48, heads=6, kv_heads=1, ffn_hidden=100,
                  tied=False),
    DecoderConfig(vocab_size=10, layers=1, hidden=16, heads=2, kv_heads=2),
])
def test_parameters_counts_every_unique_parameter(config):
    assert config.parameters() == _unique_numel(decoder(config))


def test_same_seed_same_weights_different_seed_different():
    a, b, c = decoder(SMALL, seed=3), decoder(SMALL, seed=3), decoder(SMALL, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):  # norms start at 1 whatever the seed
            assert not torch.equal(pa, pc), name
    # drawn in float32: the float64 model holds exactly the float32 values
    wide = decoder(SMALL, seed=3, dtype=F64)
    assert torch.equal(wide.embed.weight, a.embed.weight.to(F64))
    # residual outputs are scaled by 1/sqrt(2 layers) (GPT-2)
    std = a.blocks[0].mlp.down.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * SMALL.layers), rel=0.1)


def test_flops_per_token_by_hand():
    config = DecoderConfig(vocab_size=16, layers=2, hidden=8, heads=2, kv_heads=1,
                           ffn_hidden=12, seq_len=10)
    # head_dim 4, so k and v are 8 -> 4 each
    per_layer = (8 * 8      # q_proj
                 + 8 * 4    # k_proj
                 + 8 * 4    # v_proj
                 + 8 * 8    # o_proj
                 + 3 * 8 * 12)  # gate, up, down
    assert per_layer == 480
    matmul_params = 2 * per_layer + 16 * 8  # + the head (the embedding lookup is no matmul)
    # attention: 2 x 2 x T x h per layer and token forward (q.k and the sum over v), x 3
    attention = 3 * 2 * 2 * 2 * 10 * 8  # = 12 L T h = 1920
    assert config.flops_per_token() == 6 * matmul_params + attention == 8448
    assert config.flops_per_token(seq_len=20) == 6 * 1088 + 3840


def test_loss_at_init_is_about_ln_vocab():
    model = decoder(DecoderConfig(vocab_size=256))
    ids, targets = _ids((4, 64), 256), _ids((4, 64), 256, seed=1)
    with torch.no_grad():
        assert abs(model.loss(ids, targets).item() - math.log(256)) < 0.1


def test_a_few_adamw_steps_on_one_batch_lower_the_loss():
    torch.manual_seed(0)
    model = decoder(SMALL)
    ids = _ids((4, 16), 64)
    targets = torch.roll(ids, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model.loss(ids, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_rmsnorm_in_bfloat16_follows_float32():
    x = torch.randn(4, 32) * 30
    norm = RMSNorm(32)
    low = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), RMSNorm(32)(x), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("changes, field", [
    ({"hidden": 30, "heads": 4}, "heads"),
    ({"heads": 4, "kv_heads": 3}, "kv_heads"),
    ({"hidden": 12, "heads": 4}, "hidden / heads"),
])
def test_impossible_configs_are_one_line_naming_the_field(changes, field):
    with pytest.raises(ValueError) as error:
        decoder(DecoderConfig(**{**SMALL.__dict__, **changes}))
    message = str(error.value)
    assert "\n" not in message and message.startswith(field), message


def test_generate_shape_and_determinism():
    model = decoder(SMALL)
    prompt = _ids((2, 5), 64)

    def sample(seed: int) -> torch.Tensor:
        return generate(model, prompt, 20, temperature=0.8, top_k=10,
                        generator=torch.Generator().manual_seed(seed))

    out = sample(0)
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)  # 25 > seq_len: cropped
    assert torch.equal(out, sample(0))
    assert not torch.equal(out, sample(1))


def test_the_mixture_of_experts_decoder_counts_its_parameters_and_refuses_the_plain_builder():
    from minipar.moe.moe_decoder import MoEDecoder, moe_decoder

    config = DecoderConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, experts=4,
                           top_k=2)
    model = moe_decoder(config, seed=1)
    assert isinstance(model, MoEDecoder)
    assert sum(p.numel() for p in model.parameters()) == config.parameters()
    assert all(not p.any() for n, p in model.named_parameters() if n.endswith("bias"))
    dense = replace(config, experts=0)
    # a token multiplies the router and 2 of the 4 experts' two matrices, not SwiGLU's three
    h, f = config.hidden, config.ffn
    assert config.flops_per_token() - dense.flops_per_token() == \
        6 * config.layers * (h * 4 + 2 * 2 * h * f - 3 * h * f)
    with pytest.raises(ValueError, match="moe_decoder") as err:
        decoder(config)
    assert "\n" not in str(err.value)


def _uncached(model, ids, new_tokens):
    """Greedy decoding by rerunning the whole window every step: what the cache must equal."""
    for _ in range(new_tokens):
        logits = model(ids[:, -model.config.seq_len:])[:, -1, :]
        ids = torch.cat([ids, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return ids


def test_the_key_value_cache_gives_the_uncached_tokens_and_logits():
    """Greedy tokens equal rerunning the window, past seq_len too (the window slides), in
    float64; a step with the cache computes the logits of a full forward; the cache holds
    kv_heads, not heads, and the attention cores are restored after."""
    model = decoder(SMALL, seed=3, dtype=F64)
    prompt = _ids((2, 5), 64)
    assert torch.equal(generate(model, prompt, 30, temperature=0), _uncached(model, prompt, 30))
    ids = _ids((2, 9), 64)
    full = model(ids)
    cache = KVCache(SMALL.layers)
    with caching(model, cache):
        first = model(ids[:, :6])  # the prompt, then three tokens one at a time
        steps = [model(ids[:, t:t + 1], torch.tensor([t])) for t in range(6, 9)]
    assert torch.allclose(torch.cat([first, *steps], dim=1), full, rtol=1e-12, atol=1e-12)
    assert len(cache) == 9 and cache.keys[0].shape == (2, SMALL.kv_heads, 9, SMALL.head_dim)
    assert all("core" not in vars(block.attn) for block in model.blocks)


def test_a_causal_mask_with_a_past_lets_each_new_query_see_every_earlier_key():
    from minipar.decoder import attend, attention_reference, causal_mask

    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=F64) for n in (2, 5, 5))
    assert torch.allclose(attend(q, k, v), attention_reference(q, k, v), rtol=1e-12)
    whole = attention_reference(torch.cat([torch.randn(1, 2, 3, 4, generator=g, dtype=F64), q],
                                          dim=2), k, v)
    assert torch.allclose(whole[:, :, 3:], attend(q, k, v), rtol=1e-12)
