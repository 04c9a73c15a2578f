"""The attention-weighted RoPE objective (our default; the paper's is uniform): equal to a float64 computation of
sum P (dlogit)^2 / sum P logit^2 over the pairs the policy quantizes, usable by calibration, and never applied to a
recipe recorded before the option existed."""

from __future__ import annotations

import pytest
import torch

from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.objectives import layer_inputs, rope_objective
from quantmla.calibrate.trainer import calibrate_model
from quantmla.calibrate.transforms import RopeTransform
from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention
from quantmla.quant.formats import CacheFormat
from quantmla.quant.quantize import fake_quantize
from quantmla.quant.spec import QuantSpec


def test_attention_weighted_objective_matches_float64():
    model = tiny_model("deepseek_v3")
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter_mla_attention(model))
    w = extract_layer_weights(attn)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 40, model.config.hidden_size, generator=g)
    cos, sin = cos_sin_from_position_embeddings(model.model.rotary_emb(h, torch.arange(40)[None]))
    x = layer_inputs(w, spec, h, cos, sin, None, 2, 8)
    qs = QuantSpec(bits=2, group_size=16)
    r = RopeTransform(spec.qk_rope_head_dim // 2, 0.3 * torch.randn(16, generator=g), torch.randn(16, generator=g))
    got = rope_objective(x, spec, r, qs, "attention")
    pairing = spec.rope_cache_pairing
    k_hat = r.key_inverse(fake_quantize(r.key(x.k_pe, pairing), qs), pairing).double()
    d = {k: getattr(x, k).double() for k in ("q_lat", "q_pe", "c", "k_pe")}
    logits = torch.einsum("bhtc,bsc->bhts", d["q_lat"], d["c"]) + torch.einsum("bhtr,bsr->bhts", d["q_pe"], d["k_pe"])
    p = torch.softmax((logits * spec.softmax_scale).masked_fill(~x.mask, float("-inf")), -1)
    ref = torch.einsum("bhtr,bsr->bhts", d["q_pe"], d["k_pe"]) * x.mask
    err = torch.einsum("bhtr,bsr->bhts", d["q_pe"], k_hat - d["k_pe"]) * x.quant_mask
    want = (p * err**2).sum() / (p * ref**2).sum()
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(rope_objective(x, spec, r, qs, "uniform")) != pytest.approx(float(want), rel=1e-2)
    with pytest.raises(ValueError, match="weighting"):
        rope_objective(x, spec, r, qs, "softmax")


def test_calibration_with_the_attention_weighted_objective():
    with pytest.raises(ValueError, match="rope_weighting"):
        CalibrationConfig(rope_weighting="softmax")
    model = tiny_model("deepseek_v2")
    fmt = CacheFormat("c4r2-tiny", QuantSpec(bits=4, group_size=32), QuantSpec(bits=2, group_size=16))
    cfg = CalibrationConfig(seq_len=64, batch_size=2, train_seqs=4, val_seqs=2, steps_content=2, steps_rope=4,
                            query_tokens=16, sink=4, local=16, rope_weighting="attention", progress=False,
                            device="cpu")  # fmt: skip
    rep = calibrate_model(model, fmt, torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(1)), cfg)
    assert CalibrationConfig.from_dict(rep.config).rope_weighting == "attention"
    assert all(layer.rope["val_chosen"] <= layer.rope["val_identity"] for layer in rep.layers)


def test_default_objective_and_recipes_recorded_before_it():
    """The default is the attention-weighted objective; a recorded config (it carries ``version``) without
    ``rope_weighting`` was calibrated with the paper's uniform objective and must read back as such, while a
    hand-written partial config takes today's default."""
    assert CalibrationConfig().rope_weighting == "attention"
    recorded = CalibrationConfig().to_dict()
    del recorded["rope_weighting"]
    assert CalibrationConfig.from_dict(recorded).rope_weighting == "uniform"
    assert CalibrationConfig.from_dict({"steps_rope": 3}).rope_weighting == "attention"
    assert CalibrationConfig.from_dict({**recorded, "rope_weighting": "attention"}).rope_weighting == "attention"
