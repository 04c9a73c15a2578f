"""Folding random transforms of both families into a model leaves its fp32 logits unchanged, for every family and
RoPE variant; and the cache receives exactly ``c T`` and ``k_pe z``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantmla.calibrate.fuse import fold_content, fold_content_matrix, fold_rope, latent_norm_gain
from quantmla.calibrate.transforms import ContentTransform, RopeTransform, random_orthogonal
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import TINY_MODELS, tiny_model
from quantmla.mla.weights import iter_mla_attention

VARIANTS = [*TINY_MODELS, "no_latent_norm", "quantmla_mla"]


def _quantmla_mla():
    """Our converted-model class: no latent norm, rotate-half RoPE with tiled frequencies, q_proj and kv_a biases."""
    mla_model = pytest.importorskip("quantmla.models.mla_model")
    from transformers import AutoModelForCausalLM

    from quantmla.mla.tiny import tiny_config

    kw = tiny_config("deepseek_v3_half").to_dict()
    for k in ("model_type", "architectures", "transformers_version"):
        kw.pop(k, None)
    kw.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        latent_norm=False,
        rope_frequency_dim=8,
        q_bias=True,
        attention_bias=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(mla_model.QuantMLAConfig(**kw)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.05)
    return model


def _model(name: str):
    if name == "quantmla_mla":
        return _quantmla_mla()
    if name == "no_latent_norm":
        m = tiny_model("deepseek_v3")
        for _, attn in iter_mla_attention(m):
            attn.kv_a_layernorm = nn.Identity()
        return m
    return tiny_model(name)


def _random_transforms(attn, gen: torch.Generator):
    dc, pairs = attn.kv_lora_rank, attn.qk_rope_head_dim // 2
    q = random_orthogonal(dc, gen)
    v = torch.exp(0.5 * torch.randn(dc, generator=gen, dtype=torch.float64))
    g = latent_norm_gain(attn)
    if g is None:
        u = torch.exp(0.5 * torch.randn(dc, generator=gen, dtype=torch.float64))
        ct = ContentTransform(u, q, v, learn_u=True)
    else:
        ct = ContentTransform.rotation(q, norm_gain=g, new_gain=g.double() * v)
    rt = RopeTransform(
        pairs,
        0.5 * torch.randn(pairs, generator=gen, dtype=torch.float64),
        3.0 * torch.randn(pairs, generator=gen, dtype=torch.float64),
    )
    return ct, rt


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _cache_tensors(model, ids):
    from transformers import DynamicCache

    from quantmla.compat import with_cache

    cache = DynamicCache(config=model.config)
    model(ids, use_cache=True, **with_cache(cache))
    return [(layer.keys[:, 0].clone(), layer.values[:, 0].clone()) for layer in cache.layers]


@pytest.mark.parametrize("name", VARIANTS)
def test_random_transforms_fold_exactly(name):
    model = _model(name)
    spec = MLASpec.from_config(model.config)
    ids = torch.randint(3, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ref_cache = _cache_tensors(model, ids)
    gen = torch.Generator().manual_seed(7)
    transforms = []
    for _, attn in iter_mla_attention(model):
        ct, rt = _random_transforms(attn, gen)
        fold_content(attn, ct)
        fold_rope(attn, rt, spec)
        transforms.append((ct, rt))
    with torch.no_grad():
        out = model(ids).logits
        new_cache = _cache_tensors(model, ids)
    assert _rel(out, ref) <= 1e-5
    # what the cache stores is the transformed latent c T and the transformed rotated key k_pe z
    for (c, k), (c2, k2), (ct, rt) in zip(ref_cache, new_cache, transforms, strict=True):
        with torch.no_grad():
            assert _rel(c2, ct(c.double()).float()) <= 1e-5
            assert _rel(k2, rt.key(k.double(), spec.rope_cache_pairing).float()) <= 1e-5
            assert _rel(c2, c) > 1e-2 and _rel(k2, k) > 1e-2  # the transforms really changed the cache


def test_general_matrix_folds_without_norm():
    model = _model("no_latent_norm")
    ids = torch.randint(3, 128, (1, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    gen = torch.Generator().manual_seed(3)
    for _, attn in iter_mla_attention(model):
        dc = attn.kv_lora_rank
        t = torch.eye(dc, dtype=torch.float64) + 0.3 / dc**0.5 * torch.randn(dc, dc, generator=gen, dtype=torch.float64)
        fold_content_matrix(attn, t)
    with torch.no_grad():
        assert _rel(model(ids).logits, ref) <= 1e-5


def test_non_family_transform_is_refused_with_norm():
    model = tiny_model("deepseek_v3")
    _, attn = next(iter_mla_attention(model))
    dc = attn.kv_lora_rank
    with pytest.raises(ValueError, match="kv_a_layernorm"):
        fold_content_matrix(attn, torch.eye(dc, dtype=torch.float64) * 2)
    bad = ContentTransform(torch.ones(dc), torch.eye(dc, dtype=torch.float64), torch.ones(dc))  # u != 1/g
    with pytest.raises(ValueError, match="kv_a_layernorm"):
        fold_content(attn, bad)


def test_rope_transform_preserves_dot_products():
    gen = torch.Generator().manual_seed(0)
    rt = RopeTransform(4, torch.randn(4, generator=gen), torch.randn(4, generator=gen))
    q, k = torch.randn(5, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    for pairing in ("interleaved", "half"):
        with torch.no_grad():
            got = rt.query(q, pairing) @ rt.key(k, pairing).T
            back = rt.key_inverse(rt.key(k, pairing), pairing)
        torch.testing.assert_close(got, q @ k.T)
        torch.testing.assert_close(back, k)


def test_content_transform_inverse():
    gen = torch.Generator().manual_seed(0)
    dc = 16
    ct = ContentTransform(torch.rand(dc, dtype=torch.float64) + 0.5, random_orthogonal(dc, gen), torch.rand(dc) + 0.5)
    with torch.no_grad():
        ct.gen.normal_(0, 0.1)
        c = torch.randn(3, dc, dtype=torch.float64)
        torch.testing.assert_close(ct.inverse(ct(c)), c)
        torch.testing.assert_close(ct(c), c @ ct.matrix())
