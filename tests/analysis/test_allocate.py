"""Per-layer bit allocation: the solver is exact (brute force), budgets are respected and bad ones refused, the
predicted distortion of every (layer, path, bits) matches the measured output error under the cache policy, plans
round-trip and drive the cache layer by layer, and ``quantmla allocate`` writes plan + plot without clobbering."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from quantmla.analysis.allocate import (
    BITS,
    LayerSensitivity,
    Plan,
    allocate,
    layer_sensitivity,
    path_bytes,
    path_spec,
    plan_bytes,
    plan_cache,
    predicted_uniform,
    solve,
    uniform_bytes,
)
from quantmla.analysis.predictor import spearman
from quantmla.calibrate.objectives import attention_output, layer_inputs, mixed_attention_output
from quantmla.calibrate.trainer import iter_attention_inputs
from quantmla.cli import main
from quantmla.compat import with_cache
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import extract_layer_weights
from quantmla.quant.formats import CachePolicy, cache_bytes, make_format
from quantmla.quant.quantize import fake_quantize


def test_solver_finds_the_brute_force_optimum():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = 5
        sizes = [sorted(torch.randint(1, 30, (4,), generator=g).tolist()) for _ in range(n)]
        costs = [sorted(torch.rand(4, generator=g).tolist(), reverse=True) for _ in range(n)]
        lo, hi = sum(s[0] for s in sizes), sum(s[-1] for s in sizes)
        for budget in (lo, (lo + hi) // 2, lo + (hi - lo) // 5, hi):
            pick = solve(costs, sizes, budget)
            used = sum(sizes[i][o] for i, o in enumerate(pick))
            got = sum(costs[i][o] for i, o in enumerate(pick))
            best = min(sum(costs[i][o] for i, o in enumerate(c)) for c in itertools.product(range(4), repeat=n)
                       if sum(sizes[i][o] for i, o in enumerate(c)) <= budget)  # fmt: skip
            assert used <= budget and got == pytest.approx(best, rel=1e-12, abs=1e-15), (trial, budget)


def test_bad_budgets_are_refused_with_the_minimum():
    sizes, costs = [[2, 4], [3, 6]], [[1.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match=r"below the smallest plan \(5 B/token"):
        solve(costs, sizes, 4)
    with pytest.raises(ValueError, match="non-negative integer"):
        solve(costs, sizes, -1)
    with pytest.raises(ValueError, match="non-negative integer"):
        solve(costs, sizes, 5.5)


def _synthetic(layers=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        c, r = torch.rand(2, generator=g).tolist()
        scale = {"content": c * 10 ** (i % 3), "rope": r}
        # distortion falls 4x per extra bit (16x per doubling from 2 to 4, 256x from 4 to 8), 0 in BF16
        out.append(LayerSensitivity(i, {p: {"2": 16 * s, "4": s, "8": s / 256, "16": 0.0} for p, s in scale.items()}))
    return out


def test_plan_respects_the_budget_exactly_and_beats_uniform_at_equal_bytes():
    sens, dc, dr = _synthetic(), 512, 64
    for c, r in ((4, 4), (2, 4)):
        budget = uniform_bytes(c, r, dc, dr, len(sens))
        plan = allocate(sens, dc, dr, budget)
        assert plan.bytes_per_token <= budget
        assert plan.bytes_per_token == sum(f.bytes_per_token(dc, dr) for f in plan.formats)  # the real formats
        assert plan.predicted_distortion <= predicted_uniform(sens, c, r) + 1e-15
    assert {r["format"] for r in allocate(sens, dc, dr, uniform_bytes(2, 2, dc, dr, 6)).layers} == {"c2r2"}
    assert {r["format"] for r in allocate(sens, dc, dr, uniform_bytes(16, 16, dc, dr, 6)).layers} == {"bf16"}
    assert path_bytes("content", 4, 512) + path_bytes("rope", 4, 64) == make_format(4, 4).bytes_per_token() == 308
    with pytest.raises(ValueError, match="below the smallest plan"):
        allocate(sens, dc, dr, uniform_bytes(2, 2, dc, dr, 6) - 1)


@pytest.mark.parametrize("family", ["deepseek_v2", "glm4_moe_lite"])
def test_predicted_distortion_matches_the_measured_output_error(family):
    """The real QDQ error of each format injected into one path of one layer (the other exact), read through the
    mixed-precision policy: measured attention-output error energy / residual energy vs the prediction."""
    model = tiny_model(family)
    spec = MLASpec.from_config(model.config)
    toks = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    pred, meas = [], []
    for attn, x, cos, sin in iter_attention_inputs(model, toks, 2, torch.device("cpu")):
        sens = layer_sensitivity(attn, spec, x, cos, sin, 4, 16, 2, 0, torch.device("cpu"), 0)
        w = extract_layer_weights(attn).to(dtype=torch.float32)
        li = layer_inputs(w, spec, x.float(), cos, sin, None, 4, 16)
        ref = attention_output(li, w, spec, li.c, li.k_pe)
        resid = float(x.float().pow(2).sum())
        for path, bits in itertools.product(("content", "rope"), (2, 4, 8)):
            c, k = li.c, li.k_pe
            if path == "content":
                c = fake_quantize(c, path_spec(path, bits, c.shape[-1]))
            else:
                k = fake_quantize(k, path_spec(path, bits, k.shape[-1]))
            meas.append(float((mixed_attention_output(li, w, spec, c, k) - ref).pow(2).sum()) / resid)
            pred.append(sens.d(path, bits))
        assert sens.d("content", 16) == sens.d("rope", 16) == 0.0
    ratios = [p / m for p, m in zip(pred, meas)]
    assert all(0.5 < r < 2.0 for r in ratios), ratios
    assert spearman(pred, meas) > 0.95


def test_plan_round_trip_and_per_layer_cache(tmp_path):
    model = tiny_model("deepseek_v2")
    spec = MLASpec.from_config(model.config)
    dc, dr = spec.kv_lora_rank, spec.qk_rope_head_dim
    sens = _synthetic(layers=2)
    plan = allocate(sens, dc, dr, uniform_bytes(4, 4, dc, dr, 2), {"note": "test"})
    p = plan.save(str(tmp_path / "plan.json"))
    with pytest.raises(FileExistsError, match="force"):
        plan.save(p)
    back = Plan.load(p)
    assert back.to_dict() == json.loads(json.dumps(plan.to_dict())) and back.formats == plan.formats
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(2))
    pol = CachePolicy(sink=4, local=16)  # most keys read from the packed copy

    def logits(cache):
        with torch.no_grad():
            return model(ids, use_cache=True, **with_cache(cache)).logits

    def QuantMLACache(config, fmt):  # noqa: N802
        from quantmla.cache.hf import QuantMLACache as Q

        return Q(config, fmt, pol)

    uniform = Plan(dc, dr, 0, [dict(r, content_bits=2, rope_bits=4) for r in plan.layers])
    want = logits(QuantMLACache(model.config, "c2r4"))
    torch.testing.assert_close(logits(plan_cache(model.config, uniform, pol)), want, rtol=0, atol=0)
    mixed = Plan(dc, dr, 0, [dict(plan.layers[0], content_bits=2, rope_bits=4),
                             dict(plan.layers[1], content_bits=16, rope_bits=16)])  # fmt: skip
    cache = plan_cache(model.config, mixed, pol)
    out = logits(cache)
    assert [f.name for f in cache.formats] == ["c2r4", "bf16"]
    assert not torch.equal(out, logits(QuantMLACache(model.config, "c2r4")))
    assert not torch.equal(out, logits(QuantMLACache(model.config, "bf16")))
    kw = dict(kv_lora_rank=dc, rope_dim=dr, num_layers=1, context=1000)
    per_layer = [cache_bytes(f, **kw).total for f in mixed.formats]
    assert plan_bytes(mixed, 1000) == sum(per_layer) - cache_bytes("bf16", **kw).metadata  # one shared block table
    with pytest.raises(ValueError, match="another model"):
        plan_cache(model.config, Plan(dc, dr, 0, plan.layers[:1]))


def _tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = " ".join(f"the grass is green and {i} birds sing over the hills" for i in range(300))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:90])  # fmt: skip
    tok.train_from_iterator([text], trainer)
    corpus = tmp_path / "text.txt"
    corpus.write_text(text)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"), corpus


def test_allocate_command(tmp_path, capsys):
    model = tiny_model("deepseek_v3")  # 2 layers, latent 128, RoPE 32
    tok, corpus = _tokenizer_dir(tmp_path)
    d = tmp_path / "m"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    spec = MLASpec.from_config(model.config)
    budget = uniform_bytes(4, 4, spec.kv_lora_rank, spec.qk_rope_head_dim, 2)
    args = ["allocate", "--model", str(d), "--out", str(tmp_path / "plan.json"), "--corpus", str(corpus), "--seqs",
            "2", "--seq-len", "64", "--local", "16", "--query-tokens", "0", "--device", "cpu"]  # fmt: skip
    assert main([*args, "--budget-bytes-per-token", str(budget), "--plot", str(tmp_path / "plan.png")]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.bytes_per_token <= budget and len(plan.layers) == 2
    assert plan.predicted_distortion <= plan.meta["uniform_predicted"]["c4r4"] * (1 + 1e-12)
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert main([*args, "--budget-bytes-per-token", str(budget)]) == 2  # exists, no --force
    assert "exists" in capsys.readouterr().err
    lo = uniform_bytes(2, 2, spec.kv_lora_rank, spec.qk_rope_head_dim, 2)
    assert main([*args, "--force", "--budget-bytes-per-token", str(lo - 1)]) == 2
    err = capsys.readouterr().err
    assert "below the smallest plan" in err and str(lo) in err
    assert main([*args, "--force", "--avg-bits", "-1"]) == 2
    assert main([*args, "--force", "--avg-bits", "3.0"]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.bytes_per_token <= math.floor(3.0 * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 2 / 8)
    assert all(r["content_bits"] in BITS and r["rope_bits"] in BITS for r in plan.layers)
