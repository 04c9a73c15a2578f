"""QuantMLACache read in absorbed form (per-query policy, no re-expansion) vs the compatible path."""

import pytest
import torch

from quantmla.cache.hf import QuantMLACache
from quantmla.compat import with_cache
from quantmla.eval.runtime import _dynamic_cache_class
from quantmla.mla.attention import disable_absorbed_attention, enable_absorbed_attention
from quantmla.mla.tiny import TINY_MODELS, tiny_model
from quantmla.quant.formats import CachePolicy


def _decode_logits(model, ids, cache, prefill):
    out = []
    with torch.no_grad():
        o = model(ids[:, :prefill], use_cache=True, **with_cache(cache))
        out.append(o.logits[:, -1])
        for i in range(prefill, ids.shape[1]):
            o = model(ids[:, i : i + 1], use_cache=True, **with_cache(cache))
            out.append(o.logits[:, -1])
    return torch.stack(out).float()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_absorbed_bf16_cache_greedy_equals_transformers(name):
    model = tiny_model(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             **with_cache(_dynamic_cache_class()[1](config=model.config)))  # BF16 latents
        enable_absorbed_attention(model)
        got = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             **with_cache(QuantMLACache(model.config, "bf16")))
    disable_absorbed_attention(model)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("fmt", ["c4r4", "c2r4", "c4r4t"])
def test_absorbed_decode_matches_compatible_path(name, fmt):
    # Two independent read paths of the same packed store: transformers' own attention over the
    # dequantized latent (compatible path) and the absorbed per-query reference. For single-token
    # decode steps the policy gives both the same view, so the logits must agree.
    model = tiny_model(name, **({} if name == "longcat_flash" else {"first_k_dense_replace": 99}))
    pol = CachePolicy(sink=2, local=6)
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(5))
    compat = _decode_logits(model, ids, QuantMLACache(model.config, fmt, pol), prefill=8)
    enable_absorbed_attention(model)
    absorbed = _decode_logits(model, ids, QuantMLACache(model.config, fmt, pol), prefill=8)
    disable_absorbed_attention(model)
    # prefill of 8 tokens = sink 2 + local 6: every query reads every token in full precision either way.
    # The two attention forms compute a layer's output with different fp32 rounding, so the next layer's latent can
    # land on the other side of a BF16 rounding boundary in a few elements (measured: <= 2.2e-3 in the logits on
    # LongCat-Flash, 1e-6 elsewhere); reading one token from the wrong copy moves every step by >= 1.2e-2.
    torch.testing.assert_close(absorbed, compat, rtol=1e-3, atol=3e-3)


@pytest.mark.parametrize("fmt", ["c4r4", "bf16"])
def test_left_padded_batch_equals_each_prompt_alone(fmt):
    # Prompts of 11, 5 and 8 tokens, left-padded into one batch: the absorbed path stores each sequence without
    # its padding (sink = its first real tokens), so each row must continue exactly as the prompt run alone.
    # Stored with its padding, the sink would hold pad slots and the rows would drift (row 1 does: tried).
    model = tiny_model("deepseek_v3", first_k_dense_replace=99)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, model.config.vocab_size, (n,), generator=g) for n in (11, 5, 8)]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    att = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], att[b, T - len(p) :] = p, 1
    pol = CachePolicy(sink=2, local=3)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    enable_absorbed_attention(model)
    with torch.no_grad():
        cache = QuantMLACache(model.config, fmt, pol)
        batch = model.generate(ids, attention_mask=att, **kw, **with_cache(cache))
        assert cache.store.pads == [0, 6, 3]
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], **kw, **with_cache(QuantMLACache(model.config, fmt, pol)))
            assert torch.equal(batch[b, T:], alone[0, len(p) :]), f"row {b}"
    disable_absorbed_attention(model)


@pytest.mark.parametrize("fmt", ["c4r4", "bf16"])
def test_per_head_prefill_through_the_model_matches_the_latent_path(fmt, monkeypatch):
    """Chunks of several tokens ask the cache for per-head outputs (on the GPU; here forced on the CPU, where the
    cache answers with its fp32 reference): a left-padded batch's prefill and decode logits agree with the latent
    path's up to fp32 rounding, and greedy tokens are equal."""
    import quantmla.mla.attention as attention

    model = tiny_model("deepseek_v3", first_k_dense_replace=99)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(2, model.config.vocab_size, (2, 12), generator=g)
    att = torch.ones_like(ids)
    att[1, :4] = 0
    pol = CachePolicy(sink=2, local=3)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    enable_absorbed_attention(model)
    calls = []
    with torch.no_grad():
        latent = model.generate(ids, attention_mask=att, **kw, **with_cache(QuantMLACache(model.config, fmt, pol)))
        monkeypatch.setattr(attention, "per_head_prefill", lambda q: calls.append(q.shape[2]) or q.shape[2] > 1)
        heads = model.generate(ids, attention_mask=att, **kw, **with_cache(QuantMLACache(model.config, fmt, pol)))
    disable_absorbed_attention(model)
    assert 12 in calls  # the prompt went through the per-head path
    assert torch.equal(latent.sequences, heads.sequences)
    torch.testing.assert_close(torch.stack(heads.logits), torch.stack(latent.logits), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4"])
def test_post_rope_rotation_absorbed_matches_compatible_path(fmt):
    # A rounding plan with a post-RoPE rotation U: the cache stores the rotated key, the absorbed path rotates the
    # query (kernels.dispatch), the compatible path gets the key back unrotated (PagedCacheLayer.read) for
    # transformers' own attention. Both ends must agree, and the rotation must be live (other bytes than without).
    from quantmla.calibrate.query_moments import hadamard_rotation
    from quantmla.quant.rounding import RopeRounding, fit_rope_rounding

    model = tiny_model("deepseek_v3", first_k_dense_replace=99)
    dr, n = model.config.qk_rope_head_dim, model.config.num_hidden_layers
    g = torch.Generator().manual_seed(7)
    a = torch.randn(dr, dr, generator=g, dtype=torch.float64)
    plan = fit_rope_rounding(a @ a.T, rotation=hadamard_rotation(dr, seed=3))
    assert plan.rotation is not None
    pol = CachePolicy(sink=2, local=6)
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(5))
    rotated = QuantMLACache(model.config, fmt, pol, rope_rounding=[plan] * n)
    compat = _decode_logits(model, ids, rotated, prefill=8)
    plain = QuantMLACache(model.config, fmt, pol, rope_rounding=[RopeRounding(plan.order, plan.feedback)] * n)
    _decode_logits(model, ids, plain, prefill=8)
    assert not torch.equal(rotated.store.views[0].pool, plain.store.views[0].pool)
    enable_absorbed_attention(model)
    absorbed = _decode_logits(model, ids, QuantMLACache(model.config, fmt, pol, rope_rounding=[plan] * n), prefill=8)
    disable_absorbed_attention(model)
    torch.testing.assert_close(absorbed, compat, rtol=1e-3, atol=3e-3)
