"""The operator traces of the first-order predictor against Monte-Carlo: for a one-head layer and small
random-sign errors (uncorrelated elements), the mean output error energy equals sum(e^2 K)."""

from __future__ import annotations

import math

import pytest
import torch

from quantmla.analysis.predictor import operator_traces, predict_model, spearman, validate_predictor
from quantmla.calibrate.objectives import attention_output, layer_inputs
from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention
from quantmla.quant.formats import CacheFormat
from quantmla.quant.spec import QuantSpec

FMT = CacheFormat("c4r4-tiny", QuantSpec(bits=4, group_size=32), QuantSpec(bits=4, group_size=16))


@pytest.mark.parametrize("path", ["content", "rope"])
def test_traces_match_monte_carlo_for_one_head(path):
    model = tiny_model("deepseek_v2", num_attention_heads=1, num_key_value_heads=1)
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter_mla_attention(model))
    w = extract_layer_weights(attn)
    gen = torch.Generator().manual_seed(0)
    s = 24
    h = torch.randn(1, s, model.config.hidden_size, generator=gen)
    cos, sin = cos_sin_from_position_embeddings(model.model.rotary_emb(h, torch.arange(s)[None]))
    x = layer_inputs(w, spec, h, cos, sin)
    ref = attention_output(x, w, spec, x.c, x.k_pe)
    k_c, k_r = operator_traces(x, w, spec)
    clean, k = (x.c, k_c) if path == "content" else (x.k_pe, k_r)
    amp = 1e-4 * clean.abs().mean() * torch.rand(clean.shape, generator=gen)  # uneven allocation
    want = float((amp.pow(2) * k).sum())
    tot, n = 0.0, 400
    for _ in range(n):
        e = amp * (torch.randint(0, 2, clean.shape, generator=gen) * 2 - 1)
        c = x.c + e if path == "content" else x.c
        kp = x.k_pe + e if path == "rope" else x.k_pe
        tot += float((attention_output(x, w, spec, c, kp) - ref).pow(2).sum())
    assert tot / n == pytest.approx(want, rel=0.1)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)


def test_predict_model_end_to_end():
    model = tiny_model("deepseek_v3_half")
    tokens = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    rep = predict_model(model, tokens, FMT, levels=(1e-3,), batch_size=2, query_tokens=16, progress=False)
    assert len(rep.points) == 2 * MLASpec.from_config(model.config).num_cache_layers
    m = rep.metrics
    assert set(m) == {"cache_error_only", "operator_only", "operator_allocation"}
    assert m["operator_allocation"]["held_out_points"] > 0
    assert m["operator_allocation"]["median_abs_log_error"] < 1.0  # within a factor e on held-out layers
    # the reported offset and held-out error, recomputed by hand from the points: the global log offset is fitted on
    # the even layers (mean log measured / predicted), the error is the median |log| misfit on the odd layers
    layers = sorted({p.layer for p in rep.points})
    fit = [p for p in rep.points if layers.index(p.layer) % 2 == 0]
    held = [p for p in rep.points if layers.index(p.layer) % 2 == 1]
    for name in ("operator_only", "operator_allocation"):
        off = sum(math.log(p.measured / p.predicted[name]) for p in fit) / len(fit)
        errs = sorted(abs(math.log(p.measured) - math.log(p.predicted[name] * math.exp(off))) for p in held)
        assert m[name]["log_offset"] == pytest.approx(off, rel=1e-9)
        assert m[name]["median_abs_log_error"] == pytest.approx(errs[len(errs) // 2], rel=1e-9)
        assert m[name]["held_out_points"] == len(held)
    assert rep.to_dict()["points"][0]["predicted"]["cache_error_only"] == 1.0


def test_validate_predictor_on_known_points():
    """Points built so every metric is known in closed form: measured = 3 x predicted on the fitted (even) layers,
    times exp(d) on the held-out (odd) ones."""
    from quantmla.analysis.predictor import PredictedPoint

    pred = {"content": [10.0, 20.0, 30.0, 40.0], "rope": [1.0, 2.0, 3.0, 4.0]}
    dev = {(1, "content"): 0.2, (3, "content"): -0.1, (1, "rope"): 0.05, (3, "rope"): 0.3}
    pts = [
        PredictedPoint(lay, 1e-3, path, 3 * pred[path][lay] * math.exp(dev.get((lay, path), 0.0)),
                       {"cache_error_only": 1.0, "operator_only": pred[path][lay], "operator_allocation": 1.0})
        for lay in range(4) for path in ("content", "rope")
    ]  # fmt: skip
    m = validate_predictor(pts)["operator_only"]
    assert m["log_offset"] == pytest.approx(math.log(3))
    assert m["median_abs_log_error"] == pytest.approx(0.2)  # sorted |d| = 0.05, 0.1, 0.2, 0.3 -> element 2
    assert m["log_ratio_mae"] == pytest.approx((abs(0.05 - 0.2) + abs(0.3 + 0.1)) / 2)
    assert m["spearman"] == pytest.approx(1.0) and m["held_out_points"] == 4


def test_within_path_spearman_is_not_fooled_by_path_separation():
    """Content responses all far above RoPE ones: a predictor that gets the paths right but the layer order inside
    each path reversed scores a high pooled Spearman and -1 within each path."""
    from quantmla.analysis.predictor import PredictedPoint

    pts = []
    for lay in range(8):
        for path, base in (("content", 100.0), ("rope", 1.0)):
            measured = base * (1 + lay)
            pts.append(
                PredictedPoint(
                    lay,
                    1e-3,
                    path,
                    measured,
                    {"cache_error_only": 1.0, "operator_only": base * (10 - lay), "operator_allocation": measured},
                )
            )
    m = validate_predictor(pts)
    assert m["operator_only"]["spearman"] > 0.5  # pooled: looks good
    for path in ("content", "rope"):
        assert m["operator_only"]["spearman_within_path"][path] == pytest.approx(-1.0)
        assert m["operator_allocation"]["spearman_within_path"][path] == pytest.approx(1.0)
    assert m["operator_allocation"]["median_abs_log_error"] == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(m["cache_error_only"]["spearman_within_path"]["rope"])  # constant prediction
