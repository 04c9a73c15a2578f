"""The SmoothQuant-MLA baseline end to end (``calibrate_model(method="smoothquant")``): what the fused model caches
is the original latent divided by ``s_j = max|c_j|^alpha / max|W_j|^(1-alpha)`` and the original RoPE key divided
per frequency pair by ``s_p = max|k_p|^alpha / max|q_p|^(1-alpha)`` (query multiplied back), with every statistic
recomputed here in float64 from hooks on the original model over the training sequences; full precision is
unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.trainer import calibrate_model
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import iter_mla_attention
from quantmla.quant.formats import CacheFormat
from quantmla.quant.spec import QuantSpec

FMT = CacheFormat("c4r4-tiny", QuantSpec(bits=4, group_size=32), QuantSpec(bits=4, group_size=16))


def _model():
    model = tiny_model("deepseek_v3", num_hidden_layers=1)
    with torch.no_grad():  # outlier channels, as in trained MLA models
        for _, attn in iter_mla_attention(model):
            attn.kv_a_layernorm.weight[:4] *= 8.0
            attn.kv_a_proj_with_mqa.weight[attn.kv_lora_rank : attn.kv_lora_rank + 2] *= 8.0
    return model


def _capture(model, ids):
    """(latent after the norm [N, Dc], pre-RoPE key [N, Dr], pre-RoPE query RoPE parts [N, H, Dr]) in float64."""
    _, attn = next(iter_mla_attention(model))
    dc, dr, dn = attn.kv_lora_rank, attn.qk_rope_head_dim, attn.qk_nope_head_dim
    got = {}
    hooks = [
        attn.kv_a_layernorm.register_forward_hook(lambda m, i, o: got.__setitem__("c", o.detach())),
        attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: got.__setitem__("k", o[..., dc:].detach())),
        (attn.q_proj if getattr(attn, "q_proj", None) is not None else attn.q_b_proj).register_forward_hook(
            lambda m, i, o: got.__setitem__("q", o.detach())
        ),
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    q = got["q"].reshape(*got["q"].shape[:-1], -1, dn + dr)[..., dn:]  # [B, T, H, Dr]
    return got["c"].double().reshape(-1, dc), got["k"].double().reshape(-1, dr), q.double().reshape(-1, q.shape[-2], dr)


def _pair_norms(x, pairing):  # [..., Dr] -> [..., Dr/2]
    a, b = (x[..., 0::2], x[..., 1::2]) if pairing == "interleaved" else x.chunk(2, -1)
    return (a**2 + b**2).sqrt()


@pytest.mark.parametrize("alpha", [0.5, 0.85])
def test_smoothquant_scales_are_the_formula(alpha):
    from quantmla.mla.spec import MLASpec

    model = _model()
    spec = MLASpec.from_config(model.config)
    original = copy.deepcopy(model)
    tokens = torch.randint(3, 128, (6, 24), generator=torch.Generator().manual_seed(0))
    cfg = CalibrationConfig(method="smoothquant", seq_len=24, train_seqs=4, val_seqs=2, smoothquant_alphas=(alpha,),
                            sink=2, local=4, progress=False, device="cpu")  # fmt: skip
    report = calibrate_model(model, FMT, tokens, cfg)
    layer = report.layers[0]
    assert layer.content["chosen"] == layer.rope["chosen"] == f"smooth(alpha={alpha:g})"
    # the statistics, by hand, on the training sequences of the original model
    c, k, q = _capture(original, tokens[: cfg.train_seqs])
    _, attn0 = next(iter_mla_attention(original))
    w = attn0.kv_b_proj.weight.detach().double()  # [H * (Dn + Dv), Dc]
    s_c = c.abs().amax(0).clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)  # [Dc]
    pairing = spec.rope_pairing
    kmax = _pair_norms(k, pairing).amax(0)
    qmax = _pair_norms(q, pairing).flatten(0, -2).amax(0)
    s_r = kmax.clamp_min(1e-5) ** alpha / qmax.clamp_min(1e-5) ** (1 - alpha)  # [Dr/2]
    assert float(s_c.max() / s_c.min()) > 2 and float(s_r.max() / s_r.min()) > 2  # the smoothing does something
    # what the fused model caches (and queries with), on other tokens
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    c0, k0, q0 = _capture(original, ids)
    c1, k1, q1 = _capture(model, ids)
    torch.testing.assert_close(c1, c0 / s_c, rtol=1e-4, atol=1e-6)
    per_dim = s_r.repeat_interleave(2) if pairing == "interleaved" else s_r.repeat(2)  # [Dr]
    torch.testing.assert_close(k1, k0 / per_dim, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(q1, q0 * per_dim, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # folding kept full precision
        a, b = original(ids).logits, model(ids).logits
    assert float((a - b).norm() / a.norm()) < 1e-5
