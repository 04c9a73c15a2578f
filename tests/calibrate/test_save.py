"""The fused checkpoint: loading it with from_pretrained gives the in-memory fused model's logits, it records the
cache format and calibration config, an existing directory is never overwritten without force, and a failed
save leaves nothing behind. Also the ``quantmla calibrate`` command end to end on a tiny model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla.calibrate import cli
from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.fuse import QUANT_CONFIG_NAME, load_quant_config, make_quant_config, save_fused
from quantmla.calibrate.trainer import calibrate_model
from quantmla.cli_support import UsageError
from quantmla.mla.tiny import tiny_model
from quantmla.quant.formats import CacheFormat
from quantmla.quant.spec import QuantSpec

FMT = CacheFormat("c4r4-tiny", QuantSpec(bits=4, group_size=32), QuantSpec(bits=4, group_size=16))
CFG = CalibrationConfig(method="quarot", seq_len=32, train_seqs=4, val_seqs=2, progress=False)


@pytest.fixture(scope="module")
def fused():
    model = tiny_model("glm4_moe_lite")
    tokens = torch.randint(3, 128, (6, 32), generator=torch.Generator().manual_seed(0))
    report = calibrate_model(model, FMT, tokens, CFG)
    return model, report


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_roundtrip_gives_the_same_logits(fused, tmp_path):
    model, report = fused
    out = save_fused(model, tmp_path / "ckpt", make_quant_config(FMT, CFG, "quarot", report))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-6)
    assert any(p.suffix == ".safetensors" for p in out.iterdir())
    qc = load_quant_config(out)
    assert CacheFormat.from_dict(qc["cache_format"]) == FMT
    assert CalibrationConfig.from_dict(qc["calibration"]) == CFG
    assert qc["method"] == "quarot" and qc["report_summary"]["layers"] == 2


def test_refuses_to_overwrite_without_force(fused, tmp_path):
    model, _ = fused
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="force"):
        save_fused(model, out, make_quant_config(FMT))
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    save_fused(model, out, make_quant_config(FMT), force=True)
    assert not (out / "keep.txt").exists() and (out / QUANT_CONFIG_NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directories left


def test_failed_save_leaves_nothing(fused, tmp_path, monkeypatch):
    model, _ = fused
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("old")

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(model, "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_fused(model, out, make_quant_config(FMT), force=True)
    assert (out / "keep.txt").read_text() == "old"  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileExistsError):
        save_fused(model, out, make_quant_config(FMT))


def test_second_run_publishing_later_is_refused_and_the_first_kept(fused, tmp_path, monkeypatch):
    """Issue 13 item 2: two runs without force both passed the early existence check; the later one then replaced
    the first one's checkpoint. Now the final rename refuses to replace anything."""
    model, _ = fused
    out = tmp_path / "ckpt"
    real = model.save_pretrained

    def save_while_another_run_finishes(path, **kw):
        real(path, **kw)
        monkeypatch.setattr(model, "save_pretrained", real)
        save_fused(model, out, make_quant_config(FMT, method="first"))  # the other run publishes meanwhile

    monkeypatch.setattr(model, "save_pretrained", save_while_another_run_finishes)
    with pytest.raises(FileExistsError, match="force"):
        save_fused(model, out, make_quant_config(FMT, method="second"))
    assert load_quant_config(out)["method"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_reports_are_written_inside_the_checkpoint_before_it_appears(fused, tmp_path):
    from quantmla.artifacts import read_manifest

    model, report = fused
    out = save_fused(model, tmp_path / "ckpt", make_quant_config(FMT), extra_json={"r.json": report.to_dict()})
    assert json.loads((out / "r.json").read_text())["layers"] == report.to_dict()["layers"]
    assert "r.json" in read_manifest(str(out))["files"] and QUANT_CONFIG_NAME in read_manifest(str(out))["files"]
    with pytest.raises(ValueError, match="plain file names"):
        save_fused(model, tmp_path / "x", make_quant_config(FMT), extra_json={"../escape.json": {}})
    with pytest.raises(TypeError):
        save_fused(model, tmp_path / "y", make_quant_config(FMT), extra_json={"r.json": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_calibrate_command(tmp_path, monkeypatch):
    model = tiny_model("deepseek_v2")
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    ref = _logits(model, ids)
    monkeypatch.setattr(cli, "load_model", lambda d, dtype: (model, None))
    monkeypatch.setattr(
        cli, "calibration_tokens", lambda tok, cfg, corpus: torch.randint(3, 128, (cfg.train_seqs + cfg.val_seqs, 24))
    )
    import quantmla.quant.formats as formats

    monkeypatch.setattr(formats, "get_format", lambda name: FMT)
    parser = argparse.ArgumentParser()
    cli.add_calibrate_args(parser.add_subparsers(dest="command"))
    out = tmp_path / "fused"
    model.save_pretrained(tmp_path / "src")  # --model is checked (config + weights) before loading
    argv = [
        "calibrate",
        "--model",
        str(tmp_path / "src"),
        "--out",
        str(out),
        "--seq-len",
        "24",
        "--train-seqs",
        "3",
        "--val-seqs",
        "2",
        "--local",
        "4",
        "--steps",
        "3",
        "--query-tokens",
        "8",
        "--no-progress",
    ]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    qc = json.loads((out / QUANT_CONFIG_NAME).read_text())
    assert qc["method"] == "quantmla" and qc["calibration"]["steps_rope"] == 3 and qc["calibration"]["local"] == 4
    rep = json.loads((out / "calibration_report.json").read_text())
    assert len(rep["layers"]) == 2 and rep["layers"][0]["content"]["steps"] == 3
    from quantmla.artifacts import read_manifest

    assert "calibration_report.json" in read_manifest(str(out))["files"]  # published with the folder, not after
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(loaded, ids), ref, rtol=1e-4, atol=1e-5)  # fusion kept full precision
    with pytest.raises(UsageError, match="exists; pass --force"):  # refused before any work
        args.func(parser.parse_args(argv))


def test_calibrate_command_takes_a_per_token_format(tmp_path, monkeypatch):
    """``--format c4r4t`` on a model whose latent is narrower than the T formats' 512-channel group: the command's
    up-front check uses the group the cache will use (the whole latent), as the trainer does (it refused before)."""
    model = tiny_model("deepseek_v2")
    assert model.config.kv_lora_rank < 512
    monkeypatch.setattr(cli, "load_model", lambda d, dtype: (model, None))
    monkeypatch.setattr(
        cli, "calibration_tokens", lambda tok, cfg, corpus: torch.randint(3, 128, (cfg.train_seqs + cfg.val_seqs, 24))
    )
    parser = argparse.ArgumentParser()
    cli.add_calibrate_args(parser.add_subparsers(dest="command"))
    out = tmp_path / "fused"
    model.save_pretrained(tmp_path / "src")
    args = parser.parse_args(["calibrate", "--model", str(tmp_path / "src"), "--out", str(out), "--format", "c4r4t",
                              "--seq-len", "24", "--train-seqs", "3", "--val-seqs", "2", "--local", "4", "--steps",
                              "2", "--query-tokens", "8", "--no-progress"])  # fmt: skip
    assert args.func(args) == 0
    qc = json.loads((out / QUANT_CONFIG_NAME).read_text())
    assert qc["cache_format"]["name"] == "c4r4t" and qc["cache_format"]["content"]["group_size"] == 512


@pytest.mark.parametrize("rotation", ["hadamard", "none"])
def test_calibrate_command_writes_a_post_rope_rotation_by_default(rotation, tmp_path, monkeypatch):
    """The fused folder's rounding file carries a post-RoPE Hadamard rotation per layer (seed 0, recorded in
    ``quantmla.json`` and the report) unless ``--rope-rotation none``; loading the folder attaches it, full
    precision is the source model's, and a quantized cache's forward stores the rotated key (other logits than the
    same plans without the rotation, no larger error)."""
    from quantmla.cache.hf import rope_rounding_of
    from quantmla.calibrate.query_moments import (
        ROUNDING_FILE,
        hadamard_rotation,
        load_saved_rope_rounding,
        saved_moments,
    )
    from quantmla.compat import with_cache
    from quantmla.eval.runtime import CacheSpec, make_cache, prepare_model
    from quantmla.mla.weights import iter_mla_attention
    from quantmla.quant.rounding import ROPE_ROUNDING_ATTR, fit_rope_rounding

    model = tiny_model("deepseek_v2", seed=3)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    ref = _logits(model, ids)
    monkeypatch.setattr(cli, "load_model", lambda d, dtype: (model, None))
    monkeypatch.setattr(
        cli, "calibration_tokens", lambda tok, cfg, corpus: torch.randint(3, 128, (cfg.train_seqs + cfg.val_seqs, 24))
    )
    parser = argparse.ArgumentParser()
    cli.add_calibrate_args(parser.add_subparsers(dest="command"))
    out = tmp_path / "fused"
    model.save_pretrained(tmp_path / "src")
    argv = ["calibrate", "--model", str(tmp_path / "src"), "--out", str(out), "--format", "c4r4", "--seq-len", "24",
            "--train-seqs", "3", "--val-seqs", "2", "--local", "4", "--steps", "2", "--query-tokens", "8",
            "--no-progress"] + ([] if rotation == "hadamard" else ["--rope-rotation", "none"])  # fmt: skip
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    qc = json.loads((out / QUANT_CONFIG_NAME).read_text())
    rep = json.loads((out / "calibration_report.json").read_text())
    assert (out / ROUNDING_FILE).is_file() and len(saved_moments(out)) == 2
    loaded = prepare_model(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    torch.testing.assert_close(_logits(loaded, ids), ref, rtol=1e-4, atol=1e-5)  # full precision unchanged
    assert load_saved_rope_rounding(loaded, out) == 2
    plans = rope_rounding_of(loaded)
    dr = model.config.qk_rope_head_dim
    if rotation == "none":
        assert qc["rope_rounding"] == rep["rope_rounding"] == {"method": "query-aware", "rotation": None}
        assert all(p.rotation is None for p in plans)
        return
    assert qc["rope_rounding"]["rotation"]["kind"] == "hadamard" and qc["rope_rounding"]["rotation"]["seed"] == 0
    assert rep["rope_rounding"] == qc["rope_rounding"]
    for p in plans:
        u = p.rotation.double()
        assert torch.allclose(u @ u.T, torch.eye(dr, dtype=torch.float64), atol=1e-6)
        assert torch.equal(p.rotation, hadamard_rotation(dr, seed=0))

    def cached(m):
        cache = make_cache(m, CacheSpec("c4r4", sink=2, local=8))
        with torch.no_grad():
            return m(ids, **with_cache(cache), use_cache=True).logits, cache

    rotated, cache = cached(loaded)
    assert all(v.rope_rounding is not None and v.rope_rounding.rotation is not None for v in cache.store.views)
    moments = saved_moments(out)
    for i, attn in iter_mla_attention(loaded):
        setattr(attn, ROPE_ROUNDING_ATTR, fit_rope_rounding(moments[i]))  # the same moments, no rotation
    plain, _ = cached(loaded)
    assert not torch.equal(rotated, plain)  # the rotation is live in the cache's forward
    exact = _logits(loaded, ids)
    assert (rotated - exact).abs().max() < 10 * (plain - exact).abs().max()  # the same logits up to rounding error
