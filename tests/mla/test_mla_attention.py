"""Absorbed attention patched into transformers models reproduces the models' own forward (fp32, every family).

Relative error of a logits tensor = max |absorbed - reference| / max |reference|.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from quantmla.compat import with_cache
from quantmla.mla.attention import (
    attention_mask_to_bool,
    disable_absorbed_attention,
    enable_absorbed_attention,
    is_absorbed,
)
from quantmla.mla.reference import absorbed_attention
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import TINY_MODELS, tiny_model
from quantmla.mla.weights import iter_mla_attention

TOL = 1e-4  # the bound on the max relative logits error, fp32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(params=TINY_MODELS)
def model(request):
    m = tiny_model(request.param, seed=5)
    yield m
    disable_absorbed_attention(m)


@torch.no_grad()
def _greedy_run(model, prompt, steps, cache, feed=None):
    """Prefill ``prompt`` then ``steps`` greedy decode steps; ``feed`` forces the tokens fed back (teacher forcing)."""
    logits = [model(prompt, **with_cache(cache)).logits]
    tokens = []
    for i in range(steps):
        nxt = logits[-1][:, -1:].argmax(-1)  # [B, 1]
        tokens.append(nxt)
        logits.append(model(nxt if feed is None else feed[i], **with_cache(cache)).logits)
    return logits, tokens


def test_prefill_and_20_decode_steps_match_transformers(model):
    prompt = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_tokens = _greedy_run(model, prompt, 20, DynamicCache(config=model.config))
    enable_absorbed_attention(model)
    cache = DynamicCache(config=model.config)
    logits, tokens = _greedy_run(model, prompt, 20, cache, feed=ref_tokens)
    errs = [rel_err(a, b) for a, b in zip(logits, ref_logits, strict=True)]
    assert max(errs) <= TOL, errs
    assert all(torch.equal(a, b) for a, b in zip(tokens, ref_tokens, strict=True))  # same greedy choices
    assert cache.get_seq_length() == 11 + 20


@torch.no_grad()
def test_generate_gives_the_same_tokens(model):
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=10, do_sample=False, min_new_tokens=10, pad_token_id=0)
    ref = model.generate(prompt, **kw)
    enable_absorbed_attention(model)
    assert torch.equal(model.generate(prompt, **kw), ref)


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", TINY_MODELS)
@torch.no_grad()
def test_left_padded_batch_matches_transformers(name, attn_impl):
    """Batch of 2, the first row left-padded by 4: bool (sdpa) or additive float (eager) masks."""
    model = tiny_model(name, seed=6, attn_implementation=attn_impl)
    model.config._attn_implementation = attn_impl
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    ref_prefill = model(ids, attention_mask=mask).logits
    ref = model.generate(ids, return_dict_in_generate=True, output_logits=True, **kw)
    enable_absorbed_attention(model)
    prefill = model(ids, attention_mask=mask).logits
    out = model.generate(ids, return_dict_in_generate=True, output_logits=True, **kw)
    assert torch.isfinite(prefill).all()  # fully masked (padding) query rows give zeros, not NaN
    valid = mask.bool()
    assert rel_err(prefill[valid], ref_prefill[valid]) <= TOL
    assert torch.equal(out.sequences, ref.sequences)
    assert max(rel_err(a, b) for a, b in zip(out.logits, ref.logits, strict=True)) <= TOL


@torch.no_grad()
def test_no_cache_forward_matches(model):
    ids = torch.randint(3, model.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(3))
    ref = model(ids, use_cache=False).logits
    enable_absorbed_attention(model)
    assert rel_err(model(ids, use_cache=False).logits, ref) <= TOL


@torch.no_grad()
def test_disable_restores_the_model_exactly(model):
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    ref = model(ids).logits
    enable_absorbed_attention(model)
    enable_absorbed_attention(model)  # idempotent
    assert all(is_absorbed(a) for _, a in iter_mla_attention(model))
    disable_absorbed_attention(model)
    assert not any(is_absorbed(a) or "forward" in a.__dict__ for _, a in iter_mla_attention(model))
    assert torch.equal(model(ids).logits, ref)


class RecordingMLACache(DynamicCache):
    """A cache that speaks the absorbed protocol (``mla_layer``); stores through DynamicCache, attends with the
    fp32 reference, and counts calls so the test can see which path attention took."""

    def __init__(self, config):
        super().__init__(config=config)
        self.writes = self.attends = 0
        self.updates_outside_protocol = 0
        self._inside = False

    def update(self, *args, **kwargs):
        if not self._inside:
            self.updates_outside_protocol += 1
        return super().update(*args, **kwargs)

    def mla_layer(self, idx):
        return _RecordingLayer(self, idx)


class _RecordingLayer:
    def __init__(self, cache, idx):
        self.cache, self.idx = cache, idx

    def write(self, c_kv, k_pe):
        assert c_kv.dim() == 3 and k_pe.dim() == 3  # [B, T, Dc], [B, T, Dr]
        self.cache.writes += 1
        self.cache._inside = True
        self.cache.update(c_kv[:, None], k_pe[:, None], self.idx)
        self.cache._inside = False

    def get_seq_length(self):
        return self.cache.layers[self.idx].get_seq_length()

    def attend(self, q_lat, q_pe, scale, mask=None):
        self.cache.attends += 1
        layer = self.cache.layers[self.idx]
        return absorbed_attention(q_lat, q_pe, layer.keys[:, 0], layer.values[:, 0], scale, mask)


def test_protocol_layer_path_is_used_and_exact(model):
    prompt = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_tokens = _greedy_run(model, prompt, 3, DynamicCache(config=model.config))
    enable_absorbed_attention(model)
    cache = RecordingMLACache(model.config)
    logits, _ = _greedy_run(model, prompt, 3, cache, feed=ref_tokens)
    n = MLASpec.from_config(model.config).num_cache_layers
    assert cache.writes == cache.attends == 4 * n and cache.updates_outside_protocol == 0
    assert max(rel_err(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= TOL


class StrictLegacyCache(DynamicCache):
    """transformers-5.17-style ``update(k, v, layer_idx, cache_kwargs=None)``: rejects the 5.24 ``kwargs=``."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        return super().update(key_states, value_states, layer_idx)


@torch.no_grad()
def test_attention_module_accepts_both_cache_kwarg_names(model):
    """5.17 passes ``past_key_values=`` and calls ``update(k, v, idx)``; 5.24 passes ``cache=``."""
    spec = MLASpec.from_config(model.config)
    idx, attn = list(iter_mla_attention(model))[-1]
    hidden = torch.randn(2, 6, spec.hidden_size, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(6)[None].expand(2, -1)
    pe = model.model.rotary_emb(hidden, pos)
    ref_cache = DynamicCache(config=model.config)
    ref, _ = attn(hidden_states=hidden, position_embeddings=pe, attention_mask=None, **with_cache(ref_cache))
    enable_absorbed_attention(model)
    for kwarg, cache in (("cache", DynamicCache(config=model.config)), ("past_key_values", StrictLegacyCache())):
        out, weights = attn(hidden_states=hidden, position_embeddings=pe, attention_mask=None, **{kwarg: cache})
        assert weights is None
        assert rel_err(out, ref) <= 1e-5
        # the cache receives exactly what the model's own attention hands it (same RoPE column layout)
        torch.testing.assert_close(cache.layers[idx].keys, ref_cache.layers[idx].keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache.layers[idx].values, ref_cache.layers[idx].values, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_bf16_model_runs_close_to_its_own_forward():
    model = tiny_model("deepseek_v3", seed=7, dtype=torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    ref = model(ids).logits.float()
    enable_absorbed_attention(model)
    out = model(ids).logits
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) < 3e-2


def test_attention_mask_conversion():
    assert attention_mask_to_bool(None, 5) is None
    allowed = torch.tensor([[[[True, False, True, True, False, True]]]])  # [1, 1, 1, 6]
    assert torch.equal(attention_mask_to_bool(allowed, 5), allowed[..., :5])
    for neg in (torch.finfo(torch.float32).min, float("-inf")):
        additive = torch.where(allowed, torch.tensor(0.0), torch.tensor(neg))
        assert torch.equal(attention_mask_to_bool(additive, 6), allowed)
    additive16 = torch.where(allowed, torch.tensor(0.0), torch.tensor(torch.finfo(torch.bfloat16).min))
    assert torch.equal(attention_mask_to_bool(additive16.bfloat16(), 6), allowed)
    with pytest.raises(ValueError, match="4-D"):
        attention_mask_to_bool(torch.ones(3, 4, dtype=torch.bool), 4)
    with pytest.raises(TypeError, match="attn_implementation"):
        attention_mask_to_bool(object(), 4)
