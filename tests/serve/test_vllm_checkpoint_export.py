"""The vLLM export of a DeepSeek-V3 checkpoint computes the source's function: transformers' logits bit for bit,
and the same greedy tokens through the quantized cache in absorbed form (what ``quantmla generate --absorbed``
runs)."""

from __future__ import annotations

import json

import pytest
import torch

from quantmla.serve.checkpoint import export_for_vllm, interleave_permutation, vllm_ready_config


def _tiny_v3(path, *, tie=True):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
                           num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32,
                           qk_rope_head_dim=32, v_head_dim=32, max_position_embeddings=256, rope_interleave=False,
                           tie_word_embeddings=tie, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                           topk_group=1)  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def test_interleave_permutation_by_hand():
    assert interleave_permutation(8) == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError, match="even"):
        interleave_permutation(7)


def test_export_keeps_the_function(tmp_path):
    from transformers import AutoModelForCausalLM

    from quantmla.cache.hf import QuantMLACache
    from quantmla.compat import with_cache
    from quantmla.mla.attention import enable_absorbed_attention
    from quantmla.quant.formats import CachePolicy

    src = _tiny_v3(tmp_path / "src")
    export_for_vllm(str(tmp_path / "src"), str(tmp_path / "vllm"))
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["rope_interleave"] is True and cfg["tie_word_embeddings"] is False
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "vllm").eval()
    assert torch.equal(out.lm_head.weight, src.model.embed_tokens.weight)
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(out(ids).logits, src(ids).logits)  # the de-interleave undoes the row permutation exactly
        toks = []
        for m in (src, out):
            enable_absorbed_attention(m)
            cache = QuantMLACache(m.config, "c4r4", CachePolicy(sink=2, local=4, page_size=16))
            toks.append(m.generate(ids[:1], max_new_tokens=12, do_sample=False, **with_cache(cache)))
    assert torch.equal(toks[0], toks[1])


def test_export_refuses_what_vllm_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="quantmla_mla"):
        vllm_ready_config({"model_type": "quantmla_mla"})
    assert vllm_ready_config({"model_type": "deepseek_v3", "rope_interleave": True})[1] == []
    _tiny_v3(tmp_path / "src")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        export_for_vllm(str(tmp_path / "src"), str(tmp_path / "taken"))


def test_command_line(tmp_path, capsys):
    from quantmla.serve.checkpoint import main

    _tiny_v3(tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    with pytest.raises(SystemExit) as e:  # exists: refused without --force
        main([str(tmp_path / "src"), str(tmp_path / "out")])
    assert e.value.code == 2 and "--force" in capsys.readouterr().err
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), "--force"]) == 0


def test_export_carries_the_rope_rounding_and_the_plugin_renames_it_to_vllms_key(tmp_path):
    """The source folder's query moments are copied as they are (transformers de-interleaves the exported rows, so
    the cache order is unchanged: same plans, same greedy tokens through the rounding); the plugin's plans for the
    export are the source's renamed to vLLM's interleaved key: the codes of vLLM's key are the source's codes,
    permuted, bit for bit -- also with ties on the fp16 moment's diagonal."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from quantmla.cache.hf import QuantMLACache, rope_rounding_of
    from quantmla.calibrate.query_moments import load_saved_rope_rounding, save_rounding_file, saved_moments
    from quantmla.compat import with_cache
    from quantmla.mla.attention import enable_absorbed_attention
    from quantmla.quant.formats import CachePolicy, get_format
    from quantmla.quant.rounding import quantize_codes_feedback
    from quantmla.serve.vllm.config import rounding_plans

    _tiny_v3(tmp_path / "src")
    g = torch.Generator().manual_seed(3)
    moments = {}
    for i in range(2):  # ~32 +- 8 on the diagonal, stored in fp16 (steps of 1/32 there): ties are likely
        a = torch.randn(32, 32, generator=g)
        moments[i] = a @ a.T + 0.1 * torch.eye(32)
    save_rounding_file(tmp_path / "src", moments)
    export_for_vllm(str(tmp_path / "src"), str(tmp_path / "vllm"))
    src_m, out_m = saved_moments(tmp_path / "src"), saved_moments(tmp_path / "vllm")
    assert set(out_m) == {0, 1} and all(torch.equal(out_m[i], src_m[i]) for i in src_m)
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    toks, plans = [], []
    for folder in ("src", "vllm"):
        m = AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval()
        assert load_saved_rope_rounding(m, tmp_path / folder) == 2
        plans.append(rope_rounding_of(m))
        enable_absorbed_attention(m)
        cache = QuantMLACache(m.config, "c4r4", CachePolicy(sink=2, local=4, page_size=16),
                              rope_rounding=plans[-1])  # fmt: skip
        with torch.no_grad():
            toks.append(m.generate(ids, max_new_tokens=12, do_sample=False, **with_cache(cache)))
    assert torch.equal(toks[0], toks[1])
    cfg = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path / "vllm"),
                                                       hf_text_config=AutoConfig.from_pretrained(tmp_path / "vllm")),
                          parallel_config=None)  # fmt: skip
    served, first = rounding_plans(cfg)
    assert first == 0 and set(served) == {0, 1}
    perm = torch.tensor(interleave_permutation(32))
    rope = get_format("c4r4").adapted(128, 32).rope
    k = torch.randn(50, 32, generator=g) * 2  # a key in the cache's (rotate-half) order; vLLM's is k[:, perm]
    for i in range(2):
        want, ws, wo = quantize_codes_feedback(k, rope, plans[0][i])
        got, gs, go = quantize_codes_feedback(k[:, perm], rope, served[i])
        assert torch.equal(got, want[:, perm]) and torch.equal(gs, ws) and torch.equal(go, wo)
