"""Our RoPE against transformers' own rotary embeddings and apply functions of each MLA family."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3

from quantmla.mla.rope import (
    RopeConfig,
    apply_rope,
    cos_sin_from_position_embeddings,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import TINY_MODELS, tiny_config

YARN_VARIANTS = [
    dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096),  # V2-Lite
    dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
    dict(factor=8.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=64),
    dict(factor=4.0, original_max_position_embeddings=128),  # no mscale: attention factor from factor only
    dict(factor=4.0, original_max_position_embeddings=128, attention_factor=1.3, truncate=False),
    dict(factor=2.0, original_max_position_embeddings=256, beta_fast=16, beta_slow=2),
]


def _v3_config(rope_parameters: dict, dim: int = 32):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, **rope_parameters}
    return tiny_config("deepseek_v3", qk_rope_head_dim=dim, rope_parameters=params, max_position_embeddings=8192)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_inv_freq_and_attention_factor_match_model_rotary_embedding(name):
    config = tiny_config(name)
    rc = MLASpec.from_config(config).rope
    from transformers import AutoModelForCausalLM

    rotary_cls = type(AutoModelForCausalLM.from_config(config).model.rotary_emb)
    rotary = rotary_cls(config)
    torch.testing.assert_close(rope_inv_freq(rc), rotary.inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(rc) == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("variant", YARN_VARIANTS)
def test_yarn_matches_transformers(variant):
    config = _v3_config(variant)
    rotary = ds3.DeepseekV3RotaryEmbedding(config)
    rc = RopeConfig.from_config(config)
    torch.testing.assert_close(rope_inv_freq(rc), rotary.inv_freq, rtol=1e-7, atol=0)
    assert rope_attention_factor(rc) == pytest.approx(rotary.attention_scaling, rel=1e-12)


def test_yarn_attention_factor_is_not_trivial_in_tiny_v2():
    rc = MLASpec.from_config(tiny_config("deepseek_v2")).rope
    assert rc.rope_type == "yarn"
    assert abs(rope_attention_factor(rc) - 1.0) > 0.05  # the factor that scales cos/sin is exercised


def test_default_inv_freq_formula():
    rc = RopeConfig(dim=8, theta=100.0)
    expected = torch.tensor([100.0 ** (-i / 8) for i in range(0, 8, 2)], dtype=torch.float64)
    torch.testing.assert_close(rope_inv_freq(rc).double(), expected, rtol=1e-6, atol=0)


def test_frequency_dim_tiles():
    rc = RopeConfig(dim=16, theta=500.0, frequency_dim=8)
    f = rope_inv_freq(rc)
    torch.testing.assert_close(f, rope_inv_freq(RopeConfig(dim=8, theta=500.0)).repeat(2), rtol=0, atol=0)


@pytest.mark.parametrize("variant", [YARN_VARIANTS[0], YARN_VARIANTS[2]])
def test_cos_sin_match_v3_rotary_forward(variant):
    config = _v3_config(variant)
    rotary = ds3.DeepseekV3RotaryEmbedding(config)
    pos = torch.tensor([[0, 1, 5, 77, 1000], [3, 4, 5, 6, 7]])
    x = torch.zeros(1, dtype=torch.float32)
    cos_t, sin_t = rotary(x, pos)  # [B, T, Dr]
    cos, sin = rope_cos_sin(RopeConfig.from_config(config), pos)  # [B, T, Dr/2]
    torch.testing.assert_close(cos, cos_t[..., : cos.shape[-1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_t[..., : sin.shape[-1]], rtol=0, atol=1e-6)
    c2, s2 = cos_sin_from_position_embeddings((cos_t, sin_t))
    torch.testing.assert_close(c2, cos_t[..., : cos.shape[-1]], rtol=0, atol=0)
    torch.testing.assert_close(s2, sin_t[..., : cos.shape[-1]], rtol=0, atol=0)


def test_cos_sin_match_v2_freqs_cis():
    config = tiny_config("deepseek_v2")
    rotary = ds2.DeepseekV2RotaryEmbedding(config)
    pos = torch.arange(40)[None]
    freqs_cis = rotary(torch.zeros(1), pos)  # complex [1, T, Dr/2]
    cos, sin = rope_cos_sin(RopeConfig.from_config(config), pos)
    c2, s2 = cos_sin_from_position_embeddings(freqs_cis)
    torch.testing.assert_close(cos, c2, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, s2, rtol=0, atol=1e-6)


def _qk(dim: int, b: int = 2, h: int = 3, t: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, dim, generator=g), torch.randn(b, 1, t, dim, generator=g)


def test_apply_matches_v2_complex_multiply():
    config = tiny_config("deepseek_v2")
    pos = torch.arange(3, 10)[None].expand(2, -1)
    freqs_cis = ds2.DeepseekV2RotaryEmbedding(config)(torch.zeros(1), pos)
    q, k = _qk(config.qk_rope_head_dim)
    q_ref, k_ref = ds2.apply_rotary_emb(q, k, freqs_cis)
    cos, sin = cos_sin_from_position_embeddings(freqs_cis)
    torch.testing.assert_close(apply_rope(q, cos[:, None], sin[:, None], "interleaved"), q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos[:, None], sin[:, None], "interleaved"), k_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_apply_matches_v3_functions(interleave):
    config = tiny_config("deepseek_v3", rope_interleave=interleave)
    pos = torch.arange(5, 12)[None].expand(2, -1)
    cos_t, sin_t = ds3.DeepseekV3RotaryEmbedding(config)(torch.zeros(1), pos)
    q, k = _qk(config.qk_rope_head_dim)
    fn = ds3.apply_rotary_pos_emb_interleave if interleave else ds3.apply_rotary_pos_emb
    q_ref, k_ref = fn(q, k, cos_t, sin_t)
    spec = MLASpec.from_config(config)
    cos, sin = cos_sin_from_position_embeddings((cos_t, sin_t))
    q_ours = apply_rope(q, cos[:, None], sin[:, None], spec.rope_pairing, spec.rope_cache_pairing)
    k_ours = apply_rope(k, cos[:, None], sin[:, None], spec.rope_pairing, spec.rope_cache_pairing)
    torch.testing.assert_close(q_ours, q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_ours, k_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rotation_is_relative_and_norm_preserving(pairing):
    """<R(m) q, R(n) k> depends only on m - n, and |R x| = |x| (float64, analytic property)."""
    rc = RopeConfig(dim=16, theta=1000.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)

    def rot(x, p):
        cos, sin = rope_cos_sin(rc, torch.tensor([p]))
        return apply_rope(x[None], cos.double(), sin.double(), pairing)[0]

    d1 = rot(q, 10) @ rot(k, 3)
    d2 = rot(q, 107) @ rot(k, 100)
    assert d1.item() == pytest.approx(d2.item(), rel=1e-5)
    assert rot(q, 55).norm().item() == pytest.approx(q.norm().item(), rel=1e-6)


def test_out_pairing_is_a_permutation():
    x = torch.randn(2, 16)
    cos, sin = rope_cos_sin(RopeConfig(dim=16), torch.arange(2))
    a = apply_rope(x, cos, sin, "interleaved", "interleaved")
    b = apply_rope(x, cos, sin, "interleaved", "half")
    torch.testing.assert_close(b, torch.cat((a[..., 0::2], a[..., 1::2]), dim=-1), rtol=0, atol=0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        RopeConfig(dim=7)
    with pytest.raises(NotImplementedError, match="rope_type"):
        rope_inv_freq(RopeConfig(dim=8, rope_type="longrope"))
    with pytest.raises(ValueError, match="pairing"):
        apply_rope(torch.zeros(4), torch.zeros(2), torch.zeros(2), "bogus")
    assert math.isclose(rope_attention_factor(RopeConfig(dim=8)), 1.0)


V2_LITE_JSON = {  # the RoPE / attention fields of DeepSeek-V2-Lite's config.json (legacy rope_scaling format)
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}


def test_v2_lite_config_json_matches_transformers():
    """A raw config.json dict (legacy ``rope_scaling``) gives the same RoPE and softmax scale as transformers."""
    from transformers import DeepseekV2Config

    spec = MLASpec.from_config(V2_LITE_JSON)
    config = DeepseekV2Config(**{k: v for k, v in V2_LITE_JSON.items() if k != "model_type"})
    rotary = ds2.DeepseekV2RotaryEmbedding(config)
    torch.testing.assert_close(rope_inv_freq(spec.rope), rotary.inv_freq, rtol=1e-7, atol=0)
    assert rope_attention_factor(spec.rope) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    scaling = ds2.yarn_apply_mscale(config.rope_parameters, (128 + 64) ** -0.5)
    assert spec.softmax_scale == pytest.approx(scaling, rel=1e-12)
    assert spec.rope_pairing == spec.rope_cache_pairing == "interleaved"
