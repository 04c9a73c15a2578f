"""The absorbed-form reference against naive expanded attention (float64) and transformers' own MLA layers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from quantmla.compat import with_cache
from quantmla.mla.reference import (
    absorbed_attention,
    absorbed_attention_lse,
    absorbed_layer_forward,
    causal_mask,
)
from quantmla.mla.rope import rope_cos_sin
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import TINY_MODELS, tiny_model
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention

F64 = torch.float64


def _problem(b, h, t, s, dc=24, dr=8, dn=12, dv=10, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return dict(
        q_nope=r(b, h, t, dn),
        q_pe=r(b, h, t, dr),
        c_kv=r(b, s, dc),
        k_pe=r(b, s, dr),
        w_uk=r(h, dn, dc),
        w_uv=r(h, dv, dc),
    )


def _naive_expanded(p, scale, allowed):
    """Per-head keys and values built explicitly (the non-absorbed MLA), float64. Returns (out, logits)."""
    k_nope = torch.einsum("bsc,hnc->bhsn", p["c_kv"], p["w_uk"])  # [B, H, S, Dn]
    v = torch.einsum("bsc,hvc->bhsv", p["c_kv"], p["w_uv"])  # [B, H, S, Dv]
    k = torch.cat((k_nope, p["k_pe"][:, None].expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
    q = torch.cat((p["q_nope"], p["q_pe"]), dim=-1)
    logits = (q @ k.transpose(-1, -2)) * scale  # [B, H, T, S]
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v, logits


def _absorbed_out(p, scale, mask):
    q_lat = torch.einsum("bhtn,hnc->bhtc", p["q_nope"], p["w_uk"])
    o_lat, lse = absorbed_attention_lse(q_lat, p["q_pe"], p["c_kv"], p["k_pe"], scale, mask)
    return torch.einsum("bhtc,hvc->bhtv", o_lat, p["w_uv"]), lse


@pytest.mark.parametrize(
    "b,h,t,s", [(1, 1, 1, 1), (3, 5, 1, 17), (2, 3, 17, 17), (1, 4, 5, 97), (7, 2, 3, 33), (2, 16, 1, 257)]
)
def test_absorbed_equals_expanded_causal(b, h, t, s):
    p = _problem(b, h, t, s, seed=b * 1000 + s)
    scale = 0.37
    ref, logits = _naive_expanded(p, scale, causal_mask(t, s))
    out, lse = _absorbed_out(p, scale, None)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask_shape", ["b1ts", "11ts", "bhts", "ts"])
def test_absorbed_equals_expanded_with_bool_mask(mask_shape):
    b, h, t, s = 3, 4, 6, 23
    p = _problem(b, h, t, s, seed=7)
    g = torch.Generator().manual_seed(3)
    full = {"b1ts": (b, 1, t, s), "11ts": (1, 1, t, s), "bhts": (b, h, t, s), "ts": (t, s)}[mask_shape]
    mask = torch.rand(full, generator=g) < 0.6
    mask[..., 0] = True  # every row sees at least one key
    ref, logits = _naive_expanded(p, 0.5, mask)
    out, lse = _absorbed_out(p, 0.5, mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_give_zeros_not_nan():
    b, h, t, s = 2, 3, 4, 9
    p = _problem(b, h, t, s, seed=11)
    mask = torch.ones(b, 1, t, s, dtype=torch.bool)
    mask[0, :, 1] = False  # one query of batch 0 sees nothing
    mask[1] = False  # all of batch 1
    out, lse = _absorbed_out(p, 0.3, mask)
    assert torch.isfinite(out).all()
    assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
    assert torch.isneginf(lse[0, :, 1]).all() and torch.isneginf(lse[1]).all()
    ref, _ = _naive_expanded(p, 0.3, mask)
    torch.testing.assert_close(out[0, :, 0], ref[0, :, 0], rtol=1e-10, atol=1e-10)


def test_fp32_inputs_compute_in_fp32_and_match_f64():
    p64 = _problem(2, 4, 3, 50, seed=5)
    q_lat = torch.einsum("bhtn,hnc->bhtc", p64["q_nope"], p64["w_uk"])
    args64 = (q_lat, p64["q_pe"], p64["c_kv"], p64["k_pe"])
    o64 = absorbed_attention(*args64, 0.2)
    o32 = absorbed_attention(*(x.float() for x in args64), 0.2)
    o16 = absorbed_attention(*(x.bfloat16() for x in args64), 0.2)
    assert o32.dtype == torch.float32 and o16.dtype == torch.float32 and o64.dtype == F64
    torch.testing.assert_close(o32.double(), o64, rtol=1e-5, atol=1e-5)


def test_causal_mask_semantics():
    m = causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    with pytest.raises(ValueError):
        causal_mask(3, 2)


def test_shape_errors_are_clear():
    p = _problem(2, 3, 1, 5)
    q_lat = torch.zeros(2, 3, 1, 24, dtype=F64)
    with pytest.raises(ValueError, match="inconsistent"):
        absorbed_attention(q_lat, p["q_pe"], p["c_kv"][:1], p["k_pe"], 1.0)
    with pytest.raises(ValueError, match="expected"):
        absorbed_attention(q_lat[0], p["q_pe"], p["c_kv"], p["k_pe"], 1.0)


# ---- the layer in absorbed form vs transformers' attention module ------------------------------------------


@pytest.fixture(scope="module", params=TINY_MODELS)
def model(request):
    return tiny_model(request.param, seed=3)


def _module_forward(model, attn, hidden, pos, cache=None):
    pe = model.model.rotary_emb(hidden, pos)
    out, _ = attn(hidden_states=hidden, position_embeddings=pe, attention_mask=None, **with_cache(cache))
    return out


@torch.no_grad()
def test_layer_forward_matches_transformers_module(model):
    """Prefill of 9 tokens then 2 decode steps through absorbed_layer_forward, with our own RoPE tables."""
    spec = MLASpec.from_config(model.config)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 11, spec.hidden_size, generator=g)
    for layer_idx, attn in list(iter_mla_attention(model))[-2:]:
        w = extract_layer_weights(attn)
        cache = DynamicCache(config=model.config)
        past = (None, None)
        for lo, hi in ((0, 9), (9, 10), (10, 11)):
            pos = torch.arange(lo, hi)[None].expand(2, -1)
            ref = _module_forward(model, attn, hidden[:, lo:hi], pos, cache)
            cos, sin = rope_cos_sin(spec.rope, pos)
            out, c_kv, k_pe = absorbed_layer_forward(w, spec, hidden[:, lo:hi], cos, sin, *past)
            past = (c_kv, k_pe)
            rel = (out - ref).abs().max() / ref.abs().max()
            assert rel < 1e-5, (layer_idx, lo, rel.item())
        # what we would cache is what the model caches (same latent, same RoPE column layout)
        torch.testing.assert_close(c_kv, cache.layers[layer_idx].keys[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_pe, cache.layers[layer_idx].values[:, 0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_layer_forward_with_padding_mask_matches_transformers_module():
    """Left padding: the module gets transformers' additive mask, the reference the equivalent bool mask."""
    model = tiny_model("deepseek_v2", seed=4)
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter(iter_mla_attention(model)))
    hidden = torch.randn(2, 7, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    allowed = causal_mask(7, 7)[None, None].repeat(2, 1, 1, 1)  # [B, 1, T, S]
    allowed[0, :, :, :3] = False  # row 0: 3 padding tokens on the left
    allowed[0, :, :3, 0] = True  # no empty rows (the reference gives zeros there, eager softmax a uniform mean)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    pos = torch.arange(7)[None].expand(2, -1)
    pe = model.model.rotary_emb(hidden, pos)
    ref, _ = attn(hidden_states=hidden, position_embeddings=pe, attention_mask=additive)
    cos, sin = rope_cos_sin(spec.rope, pos)
    out, _, _ = absorbed_layer_forward(extract_layer_weights(attn), spec, hidden, cos, sin, mask=allowed)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
