"""Weight extraction, write-back, the walk over MLA layers, the spec read from each family, and non-MLA models."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from quantmla.compat import with_cache
from quantmla.mla.attention import enable_absorbed_attention
from quantmla.mla.spec import MLASpec, UnsupportedModelError
from quantmla.mla.tiny import TINY_MODELS, tiny_config, tiny_model
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention, load_layer_weights


@pytest.fixture(scope="module", params=TINY_MODELS)
def name_model(request):
    return request.param, tiny_model(request.param, seed=1)


def test_spec_matches_modules(name_model):
    name, model = name_model
    spec = MLASpec.from_config(model.config)
    layers = list(iter_mla_attention(model))
    assert len(layers) == spec.num_cache_layers
    for _, attn in layers:
        assert spec.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
        assert spec.num_heads == attn.num_heads and spec.kv_lora_rank == attn.kv_lora_rank
        assert spec.q_scale == pytest.approx(getattr(attn, "mla_scale_q_lora", 1.0))
        assert spec.kv_scale == pytest.approx(getattr(attn, "mla_scale_kv_lora", 1.0))
    expected = {"deepseek_v2": "interleaved", "deepseek_v3_half": "half"}.get(name, "interleaved")
    assert spec.rope_pairing == expected
    assert MLASpec(**spec.to_dict()) == spec  # round trip through a plain dict


@torch.no_grad()
def test_cache_layers_are_indexed_by_layer_idx(name_model):
    """DynamicCache gets one layer per attention module, and the module with ``layer_idx`` i writes cache layer i."""
    _, model = name_model
    spec = MLASpec.from_config(model.config)
    inputs = {}
    hooks = [
        attn.register_forward_pre_hook(
            lambda m, a, kw, i=idx: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True
        )
        for idx, attn in iter_mla_attention(model)
    ]
    cache = DynamicCache(config=model.config)
    model(torch.randint(3, 100, (1, 5)), **with_cache(cache))
    for h in hooks:
        h.remove()
    assert len(cache.layers) == spec.num_cache_layers == len(inputs)
    for idx, attn in iter_mla_attention(model):
        latent = attn.kv_a_proj_with_mqa(inputs[idx])[..., : spec.kv_lora_rank]
        c_kv = attn.kv_a_layernorm(latent) * spec.kv_scale  # [1, 5, Dc]
        torch.testing.assert_close(cache.layers[idx].keys[:, 0], c_kv, rtol=1e-6, atol=1e-6)


def test_longcat_two_attention_modules_per_block():
    model = tiny_model("longcat_flash")
    spec = MLASpec.from_config(model.config)
    assert spec.num_layers == model.config.num_layers == len(model.model.layers)
    assert spec.num_cache_layers == 2 * spec.num_layers == model.config.num_hidden_layers
    by_idx = dict(iter_mla_attention(model))
    for i, block in enumerate(model.model.layers):
        assert by_idx[2 * i] is block.self_attn[0] and by_idx[2 * i + 1] is block.self_attn[1]
    # also from a plain config.json dict that only names num_layers
    as_json = {k: v for k, v in model.config.to_dict().items() if k != "num_hidden_layers"}
    assert MLASpec.from_config(as_json).num_cache_layers == spec.num_cache_layers


@torch.no_grad()
def test_extracted_up_projections_reproduce_kv_b_proj(name_model):
    _, model = name_model
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter(iter_mla_attention(model)))
    w = extract_layer_weights(attn)
    c = torch.randn(3, spec.kv_lora_rank)
    kv = attn.kv_b_proj(c).view(3, spec.num_heads, -1)  # [N, H, Dn + Dv]
    k_nope, v = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
    torch.testing.assert_close(torch.einsum("nc,hdc->nhd", c, w.w_uk), k_nope, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.einsum("nc,hdc->nhd", c, w.w_uv), v, rtol=1e-5, atol=1e-6)
    x = torch.randn(3, spec.hidden_size)
    latent, rope = attn.kv_a_proj_with_mqa(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    torch.testing.assert_close(x @ w.kv_a_latent.T, latent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x @ w.kv_a_rope.T, rope, rtol=1e-5, atol=1e-6)
    assert (w.kv_norm is None) == (getattr(attn.kv_a_layernorm, "weight", None) is None)
    assert (w.q_proj is None) == (spec.q_lora_rank is not None)


@torch.no_grad()
def test_round_trip_into_another_model(name_model):
    """Weights extracted from model A and loaded into model B (other seed) make B's attention equal A's."""
    name, model_a = name_model
    model_b = tiny_model(name, seed=99)
    layers_a, layers_b = dict(iter_mla_attention(model_a)), dict(iter_mla_attention(model_b))
    idx = max(layers_a)
    a, b = layers_a[idx], layers_b[idx]
    assert not torch.equal(a.kv_b_proj.weight, b.kv_b_proj.weight)
    load_layer_weights(b, extract_layer_weights(a))
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    copy = extract_layer_weights(a, copy=True)
    assert copy.w_uk.data_ptr() != a.kv_b_proj.weight.data_ptr()


def test_load_rejects_mismatched_shapes():
    model = tiny_model("deepseek_v2")
    other = tiny_model("deepseek_v3")
    (_, attn), (_, attn_other) = next(iter(iter_mla_attention(model))), next(iter(iter_mla_attention(other)))
    with pytest.raises(ValueError, match="shape mismatch|one side only"):
        load_layer_weights(attn, extract_layer_weights(attn_other))


def test_weights_to_dtype():
    model = tiny_model("glm4_moe_lite")
    w = extract_layer_weights(next(iter(iter_mla_attention(model)))[1]).to(torch.float64)
    assert w.w_uk.dtype == torch.float64 and w.q_a_proj.dtype == torch.float64 and w.q_a_norm_eps is not None


def _tiny_llama():
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_non_mla_model_is_rejected_clearly():
    model = _tiny_llama()
    for fn in (lambda: list(iter_mla_attention(model)), lambda: enable_absorbed_attention(model)):
        with pytest.raises(UnsupportedModelError, match="'llama' is not an MLA model") as err:
            fn()
        assert "deepseek_v2" in str(err.value) and "convert" in str(err.value)
    with pytest.raises(UnsupportedModelError, match="not an MLA attention module"):
        extract_layer_weights(model.model.layers[0].self_attn)


def test_config_missing_mla_fields_is_rejected():
    d = tiny_config("deepseek_v3").to_dict()
    del d["kv_lora_rank"]
    with pytest.raises(UnsupportedModelError, match="kv_lora_rank"):
        MLASpec.from_config(d)
