"""Learning: the straight-through estimator passes gradients, the config round-trips and validates, and transforms
learned from the identity lower both objectives on held-out sequences of a model with outlier channels."""

from __future__ import annotations

import pytest
import torch

from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.objectives import (
    attention_output,
    content_objective,
    layer_inputs,
    mixed_attention_output,
    ste_fake_quantize,
)
from quantmla.calibrate.query_moments import query_moments
from quantmla.calibrate.trainer import calibrate_model, warmup_cosine
from quantmla.calibrate.transforms import ContentTransform
from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention
from quantmla.quant.formats import CacheFormat
from quantmla.quant.quantize import fake_quantize
from quantmla.quant.spec import QuantSpec

FMT = CacheFormat("c2r4-tiny", QuantSpec(bits=2, group_size=32), QuantSpec(bits=4, group_size=16))


def test_ste_forward_is_exact_and_gradient_is_straight_through_inside_the_range():
    spec = QuantSpec(bits=2, group_size=32)
    x = torch.randn(3, 64, requires_grad=True)
    y = ste_fake_quantize(x, spec)
    assert torch.equal(y, fake_quantize(x.detach(), spec))  # the forward value is what the cache stores
    assert not torch.equal(y, x)
    wts = torch.randn(3, 64)
    (y * wts).sum().backward()
    xg = x.detach().reshape(3, 2, 32)
    extreme = (xg == xg.amax(-1, keepdim=True)) | (xg == xg.amin(-1, keepdim=True))
    inner = ~extreme.reshape(3, 64)
    torch.testing.assert_close(x.grad[inner], wts[inner])  # rounding is passed straight through
    assert (x.grad[~inner] - wts[~inner]).abs().max() > 0  # the range (step, offset) carries gradient


def test_content_objective_gradient_reaches_every_parameter():
    model = tiny_model("deepseek_v3")
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter_mla_attention(model))
    w = extract_layer_weights(attn)
    h = torch.randn(2, 24, model.config.hidden_size)
    pos = torch.arange(24)[None]
    cos, sin = cos_sin_from_position_embeddings(model.model.rotary_emb(h, pos))
    x = layer_inputs(w, spec, h, cos, sin)
    dc = attn.kv_lora_rank
    t = ContentTransform.identity(dc, attn.kv_a_layernorm.weight)
    with torch.no_grad():
        t.gen.normal_(0, 0.01)  # away from the identity, where the rotation gradient can vanish by symmetry
    loss = content_objective(x, w, spec, t, QuantSpec(bits=2, group_size=32))
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert t.gen.grad.abs().sum() > 0 and t.log_v.grad.abs().sum() > 0
    assert t.log_u.grad is None  # pinned to 1/g with a latent norm


def test_mixed_policy_attention_reads_exact_protected_keys():
    model = tiny_model("deepseek_v3")
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter_mla_attention(model))
    w = extract_layer_weights(attn)
    s = 20
    h = torch.randn(1, s, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = cos_sin_from_position_embeddings(model.model.rotary_emb(h, torch.arange(s)[None]))
    x = layer_inputs(w, spec, h, cos, sin, sink=2, local=5)
    c_hat, k_hat = x.c + 0.3 * torch.randn_like(x.c), x.k_pe + 0.3 * torch.randn_like(x.k_pe)
    got = mixed_attention_output(x, w, spec, c_hat, k_hat)  # [1, S, D]
    for t in (0, 6, 7, 19):  # independent: build each query's key set by hand, attend with the plain reference
        quant = [j for j in range(t + 1) if j >= 2 and j <= t - 5]
        c_t, k_t = x.c[:, : t + 1].clone(), x.k_pe[:, : t + 1].clone()
        c_t[:, quant], k_t[:, quant] = c_hat[:, quant], k_hat[:, quant]
        xt = layer_inputs(w, spec, h[:, : t + 1], cos, sin, torch.tensor([t]))
        want = attention_output(xt, w, spec, c_t, k_t)[:, 0]
        torch.testing.assert_close(got[:, t], want, rtol=1e-4, atol=1e-5)
    assert x.quant_mask[19].sum() == 13 and not x.quant_mask[6].any()


def test_config_roundtrip_and_validation():
    cfg = CalibrationConfig(method="smoothquant", steps_content=10, smoothquant_alphas=[0.5, 1.0])
    assert CalibrationConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.smoothquant_alphas == (0.5, 1.0)
    d = CalibrationConfig().to_dict()
    assert (d["seq_len"], d["batch_size"], d["train_seqs"], d["val_seqs"]) == (2048, 4, 128, 32)
    assert (d["steps_content"], d["steps_rope"], d["weight_decay"], d["warmup_frac"]) == (300, 300, 0.0, 0.1)
    for bad in (dict(method="gptq"), dict(batch_size=0), dict(warmup_frac=1.0), dict(device="tpu")):
        with pytest.raises(ValueError):
            CalibrationConfig(**bad)
    with pytest.raises(ValueError, match="matmul_precision='bf16'; choose one of"):
        CalibrationConfig(matmul_precision="bf16")
    assert CalibrationConfig.from_dict({"version": 1}).matmul_precision == "fp32"  # recorded before the option
    with pytest.raises(ValueError, match="unknown"):
        CalibrationConfig.from_dict({"nope": 1})


def test_presets():
    fast = CalibrationConfig.preset("cpu-fast", seed=3)
    assert fast.seq_len < 2048 and fast.seed == 3 and CalibrationConfig.preset("paper") == CalibrationConfig()
    with pytest.raises(ValueError, match="preset"):
        CalibrationConfig.preset("huge")


def test_warmup_then_cosine():
    f = warmup_cosine(100, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.5, abs=0.02) and f(99) < 0.01


def _outlier_model():
    """A tiny model whose latent and RoPE key have a few large channels, as trained MLA models do."""
    model = tiny_model("deepseek_v3", num_hidden_layers=1)
    with torch.no_grad():
        for _, attn in iter_mla_attention(model):
            attn.kv_a_layernorm.weight[:4] *= 8.0
            dc = attn.kv_lora_rank
            attn.kv_a_proj_with_mqa.weight[dc : dc + 2] *= 8.0  # one interleaved frequency pair
    return model


def test_learned_transforms_beat_identity_on_held_out_data():
    torch.manual_seed(0)
    model = _outlier_model()
    tokens = torch.randint(3, 128, (24, 64), generator=torch.Generator().manual_seed(0))
    cfg = CalibrationConfig(
        seq_len=64,
        train_seqs=16,
        val_seqs=8,
        steps_content=60,
        steps_rope=60,
        query_tokens=32,
        content_init="identity",
        rope_init="identity",
        sink=2,
        local=8,
        select_on_val=False,
        progress=False,
    )
    with torch.no_grad():
        ref = model(tokens[:2]).logits
    report = calibrate_model(model, FMT, tokens, cfg, query_moments=True)
    for layer in report.layers:
        for path in (layer.content, layer.rope):
            assert path["chosen"] == "learned" and path["init"] == "identity"
            assert path["val"]["learned"] < 0.9 * path["val"]["identity"], path
    with torch.no_grad():  # folding kept full precision
        out = model(tokens[:2]).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    s = report.summary()
    assert s["content_val_chosen"] < s["content_val_identity"] and s["rope_val_chosen"] < s["rope_val_identity"]
    # the moments measured inside the loop are those of a separate pass through the folded model (exact arithmetic:
    # the same; here up to float rounding) and stay out of the report's JSON
    again = query_moments(model, tokens[:16], sink=2, local=8)
    assert set(report.query_moments) == set(again) == {0}
    for i, h in again.items():
        torch.testing.assert_close(report.query_moments[i], h, rtol=1e-4, atol=1e-6)
    assert "query_moments" not in report.to_dict()


def test_too_few_sequences_is_a_clear_error():
    model = tiny_model("deepseek_v2")
    cfg = CalibrationConfig(seq_len=16, train_seqs=4, val_seqs=2, progress=False)
    with pytest.raises(ValueError, match="calibration sequences"):
        calibrate_model(model, FMT, torch.randint(3, 128, (5, 16)), cfg)


def test_sequences_the_policy_keeps_in_full_precision_are_refused():
    """With sink + local >= seq_len every key is read exactly: the objectives are 0 and nothing can be learned."""
    model = tiny_model("deepseek_v2")
    cfg = CalibrationConfig(seq_len=16, train_seqs=2, val_seqs=1, sink=4, local=12, progress=False)
    with pytest.raises(ValueError, match="every key is read in full precision"):
        calibrate_model(model, FMT, torch.randint(3, 128, (3, 16)), cfg)
    with pytest.warns(UserWarning, match="short for local window"):
        calibrate_model(model, FMT, torch.randint(3, 128, (3, 16)), CalibrationConfig.from_dict(
            {**cfg.to_dict(), "local": 8, "steps_content": 1, "steps_rope": 1}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_on_cuda_one_block_at_a_time():
    """device="cuda": every block goes to the GPU for its turn and back; full precision is unchanged; the learned
    transforms validate no worse than the identity."""
    model = _outlier_model()
    tokens = torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(1))
    cfg = CalibrationConfig(seq_len=64, train_seqs=4, val_seqs=2, steps_content=5, steps_rope=5, query_tokens=16,
                            sink=2, local=8, device="cuda", progress=False)  # fmt: skip
    with torch.no_grad():
        ref = model(tokens[:2]).logits
    report = calibrate_model(model, FMT, tokens, cfg)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        out = model(tokens[:2]).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    s = report.summary()
    assert s["content_val_chosen"] <= s["content_val_identity"] and s["rope_val_chosen"] <= s["rope_val_identity"]


def test_training_steps_draw_their_batches_in_the_seeded_order(monkeypatch):
    """The training loop draws every step's sequences and query positions up front (one copy to the device instead
    of one per step): the batches it trains on are still, step by step, ``randint`` then ``sample_queries`` from the
    path's seeded generator -- the order a step-by-step draw gives (the reference written out here)."""
    from quantmla.calibrate import trainer
    from quantmla.calibrate.objectives import sample_queries

    monkeypatch.setattr(trainer, "TRAIN_CACHE_BYTES", 0)  # the path that gathers from the bank every step
    seen, state = [], {"in_train": None}
    real_inputs, real_train = trainer.LayerProblem.inputs, trainer.LayerProblem.train

    def inputs(self, hidden, qidx):
        if state["in_train"] is not None:
            seen.append((state["in_train"], hidden.clone(), None if qidx is None else qidx.clone()))
        return real_inputs(self, hidden, qidx)

    def train(self, path, transform, steps, lr, desc):
        state["in_train"] = (self, path)
        try:
            return real_train(self, path, transform, steps, lr, desc)
        finally:
            state["in_train"] = None

    monkeypatch.setattr(trainer.LayerProblem, "inputs", inputs)
    monkeypatch.setattr(trainer.LayerProblem, "train", train)
    model = tiny_model("deepseek_v2")
    tokens = torch.randint(3, 128, (10, 64), generator=torch.Generator().manual_seed(2))
    cfg = CalibrationConfig(seq_len=64, train_seqs=7, val_seqs=3, batch_size=3, steps_content=5, steps_rope=4,
                            query_tokens=16, sink=2, local=8, progress=False)  # fmt: skip
    calibrate_model(model, FMT, tokens, cfg)
    by_call: dict = {}
    for (prob, path), hidden, qidx in seen:
        by_call.setdefault((id(prob), path), (prob, path, []))[2].append((hidden, qidx))
    assert len(by_call) == 2 * model.config.num_hidden_layers
    for prob, path, got in by_call.values():
        gen = torch.Generator().manual_seed(prob.seed + (0 if path == "content" else 7919))
        n, seq = prob.banks.train.shape[:2]
        assert len(got) == (cfg.steps_content if path == "content" else cfg.steps_rope)
        for hidden, qidx in got:
            idx = torch.randint(n, (min(cfg.batch_size, n),), generator=gen)
            want_q = sample_queries(seq, cfg.query_tokens, gen)
            assert torch.equal(hidden, prob.banks.train[idx]) and torch.equal(qidx, want_q)


def test_matmul_precision_holds_inside_calibration_only(monkeypatch):
    """``tf32`` switches CUDA fp32 GEMMs to TF32 while each attention module is calibrated (``fp32`` forces full
    fp32 there even when the process allows TF32) and the process's setting comes back after; on the CPU the
    learned transforms are the same bit for bit (TF32 is a CUDA matter)."""
    from quantmla.calibrate import trainer

    m = torch.backends.cuda.matmul
    seen, real_path = [], trainer._path

    def path(*a, **k):
        seen.append(m.fp32_precision)
        return real_path(*a, **k)

    monkeypatch.setattr(trainer, "_path", path)
    tokens = torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(3))
    cfg = CalibrationConfig(seq_len=64, train_seqs=4, val_seqs=2, steps_content=4, steps_rope=4, query_tokens=16,
                            sink=2, local=8, progress=False)  # fmt: skip
    before = m.fp32_precision
    out = {}
    for prec in ("tf32", "fp32"):
        seen.clear()
        model = tiny_model("deepseek_v2")
        calibrate_model(model, FMT, tokens, CalibrationConfig.from_dict({**cfg.to_dict(), "matmul_precision": prec}))
        assert seen and set(seen) == {"tf32" if prec == "tf32" else "ieee"} and m.fp32_precision == before
        out[prec] = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(out["tf32"][k], out["fp32"][k]) for k in out["fp32"])
    m.fp32_precision = "tf32"  # a process that allows TF32: fp32 calibration still computes in fp32, then restores
    try:
        seen.clear()
        calibrate_model(tiny_model("deepseek_v2"), FMT, tokens, cfg)
        assert set(seen) == {"ieee"} and m.fp32_precision == "tf32"
    finally:
        m.fp32_precision = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_calibration_on_cuda_lands_near_fp32():
    """TF32 products (10-bit mantissas) are far finer than the 2-bit content quantization the objective measures:
    the transforms learned with them validate within 5% of the fp32-learned ones, and below the identity."""
    tokens = torch.randint(3, 128, (10, 128), generator=torch.Generator().manual_seed(4))
    cfg = CalibrationConfig(seq_len=128, train_seqs=8, val_seqs=2, steps_content=30, steps_rope=30,
                            query_tokens=32, sink=2, local=8, device="cuda", progress=False)  # fmt: skip
    s = {}
    for prec in ("fp32", "tf32"):
        one = CalibrationConfig.from_dict({**cfg.to_dict(), "matmul_precision": prec})
        s[prec] = calibrate_model(_outlier_model(), FMT, tokens, one).summary()
    for path in ("content", "rope"):
        got, want = s["tf32"][f"{path}_val_chosen"], s["fp32"][f"{path}_val_chosen"]
        assert got <= s["tf32"][f"{path}_val_identity"] and abs(got - want) <= 0.05 * want, (path, got, want)
