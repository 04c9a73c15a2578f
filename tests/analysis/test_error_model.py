"""The dual-path error model against the model's own attention forward: an error injected through a cache stub
into the module's expanded (non-absorbed) attention gives the same output NMSE as the analysis computes."""

from __future__ import annotations

import json

import pytest
import torch

from quantmla.analysis.error_model import analyze_model, intervene, layer_response, plot_atlas
from quantmla.compat import with_cache
from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import iter_mla_attention
from quantmla.quant.formats import CacheFormat
from quantmla.quant.quantize import fake_quantize
from quantmla.quant.spec import QuantSpec

FMT = CacheFormat("c4r4-tiny", QuantSpec(bits=4, group_size=32), QuantSpec(bits=4, group_size=16))


class _InjectCache:
    """Receives (c_kv, k_pe) from the attention module and hands back perturbed copies."""

    def __init__(self, path: str, level: float):
        self.path, self.level = path, level

    def update(self, c, k, layer_idx, *args, **kwargs):
        x = c if self.path == "content" else k
        spec = FMT.content if self.path == "content" else FMT.rope
        e = fake_quantize(x, spec) - x
        e = e * torch.sqrt(self.level * x.pow(2).sum() / e.pow(2).sum())
        return (c + e, k) if self.path == "content" else (c, k + e)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_matches_the_module_forward(name):
    model = tiny_model(name)
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter_mla_attention(model))
    s = 40
    h = torch.randn(1, s, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pe = model.model.rotary_emb(h, torch.arange(s)[None])
    cos, sin = cos_sin_from_position_embeddings(pe)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    (got,) = layer_response(attn, spec, h, cos, sin, FMT, [1e-3], batch_size=1, query_tokens=0)
    bias = 0 if attn.o_proj.bias is None else attn.o_proj.bias
    with torch.no_grad():
        ref = attn(h, position_embeddings=pe, attention_mask=mask)[0] - bias
        for path, value in (("content", got.content_out_nmse), ("rope", got.rope_out_nmse)):
            inject = with_cache(_InjectCache(path, 1e-3))
            out = attn(h, position_embeddings=pe, attention_mask=mask, **inject)[0] - bias
            want = float((out - ref).pow(2).sum() / ref.pow(2).sum())
            assert value == pytest.approx(want, rel=2e-3), path
    assert got.content_response == pytest.approx(got.content_out_nmse / 1e-3)
    assert got.ratio == pytest.approx(got.rope_response / got.content_response)


def test_interventions_keep_energy():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(2, 9, 16, generator=gen) * torch.linspace(0.1, 3, 16)
    for kind in ("sign", "token_permutation", "isotropic"):
        out = intervene(e, kind, gen)
        assert out.shape == e.shape and not torch.equal(out, e)
        torch.testing.assert_close(out.pow(2).sum(), e.pow(2).sum())
    with pytest.raises(ValueError):
        intervene(e, "shuffle", gen)


def test_analyze_model_end_to_end(tmp_path):
    model = tiny_model("longcat_flash")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(3, 128, (3, 32), generator=torch.Generator().manual_seed(1))
    rep = analyze_model(
        model,
        tokens,
        FMT,
        levels=(1e-2, 1e-3),
        batch_size=2,
        query_tokens=16,
        interventions=("sign", "isotropic"),
        repeats=2,
        progress=False,
    )
    n_attn = MLASpec.from_config(model.config).num_cache_layers
    assert len(rep.layers) == 2 * n_attn and len(rep.at(1e-3)) == n_attn
    for r in rep.layers:
        assert r.content_response > 0 and r.rope_response > 0
        assert set(r.interventions["rope"]) == {"sign", "isotropic"}
    ml = rep.model_level()
    assert set(ml) == {"0.01", "0.001"} and ml["0.001"]["ratio"] > 0
    # small errors act linearly: the gain barely depends on the level
    assert ml["0.01"]["content_response"] == pytest.approx(ml["0.001"]["content_response"], rel=0.3)
    d = json.loads(rep.save_json(tmp_path / "em.json").read_text())
    assert d["model_level"]["0.01"]["rope_response"] == pytest.approx(ml["0.01"]["rope_response"])
    png = plot_atlas(rep, tmp_path / "atlas.png")  # matplotlib is a dev/eval dependency: the plot must be made
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(png)  # [H, W, 3 or 4]
    assert img.shape[0] > 100 and img.shape[1] > 100 and float(img[..., :3].std()) > 0.01  # not a blank canvas
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not modified
