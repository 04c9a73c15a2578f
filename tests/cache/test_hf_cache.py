"""QuantMLACache inside transformers' own generate / forward for every supported family."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from quantmla.cache.hf import QuantMLACache
from quantmla.compat import with_cache
from quantmla.eval.runtime import _dynamic_cache_class
from quantmla.mla.spec import UnsupportedModelError
from quantmla.mla.tiny import TINY_MODELS, tiny_model
from quantmla.quant.formats import CachePolicy


def _greedy(model, ids, cache, n=12):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, **with_cache(cache))


def _logits(model, ids, cache, steps=8):
    """Prefill then `steps` teacher-forced decode steps; logits of every step [steps+1, B, V]."""
    out = []
    with torch.no_grad():
        o = model(ids[:, :-steps], **with_cache(cache), use_cache=True)
        out.append(o.logits[:, -1])
        for i in range(steps, 0, -1):
            o = model(ids[:, -i : ids.shape[1] - i + 1], **with_cache(cache), use_cache=True)
            out.append(o.logits[:, -1])
    return torch.stack(out)


def _nmse(a, b):
    return float(((a - b) ** 2).mean() / (b**2).mean())


def bf16_dynamic_cache(config):
    """transformers' own DynamicCache holding the latents rounded to BF16 (what the BF16 format stores)."""
    return _dynamic_cache_class()[1](config=config)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_bf16_format_greedy_tokens_equal_transformers_cache(name):
    # The BF16 format stores BF16 (also on an fp32 model): transformers' cache of BF16-rounded latents is the
    # reference, and the compatible path returns exactly those values.
    model = tiny_model(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _greedy(model, ids, bf16_dynamic_cache(model.config))
    got = _greedy(model, ids, QuantMLACache(model.config, "bf16"))
    assert torch.equal(ref, got)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_quantized_logits_error_ordered_by_bits(name):
    # Dense MLPs: in a tiny random MoE a small perturbation can flip the top-k routing and swamp the
    # cache error being measured (LongCat-Flash's router is smooth enough at this size).
    model = tiny_model(name, **({} if name == "longcat_flash" else {"first_k_dense_replace": 99}))
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, ids, DynamicCache(config=model.config))
    pol = CachePolicy(sink=2, local=4)
    err = {f: _nmse(_logits(model, ids, QuantMLACache(model.config, f, pol)), ref) for f in ("c8r8", "c4r4", "c2r4")}
    assert err["c8r8"] < 1e-3, err  # stated tolerance for C8R8: logit NMSE below 1e-3
    assert err["c8r8"] < err["c4r4"] < err["c2r4"], err


def test_long_prompt_decode_and_second_prompt_appended():
    model = tiny_model("deepseek_v3")
    g = torch.Generator().manual_seed(3)
    p1 = torch.randint(0, 128, (1, 300), generator=g)
    cache = QuantMLACache(model.config, "c4r4", CachePolicy(4, 16))
    with torch.no_grad():
        out = model.generate(p1, max_new_tokens=5, min_new_tokens=5, do_sample=False, **with_cache(cache))
        p2 = torch.cat([out, torch.randint(0, 128, (1, 40), generator=g)], dim=1)
        out2 = model.generate(p2, max_new_tokens=5, min_new_tokens=5, do_sample=False, **with_cache(cache))
    assert out2.shape[1] == 300 + 5 + 40 + 5
    assert cache.get_seq_length() == 300 + 5 + 40 + 4  # the last generated token is not yet cached
    rep = cache.memory_report()
    assert rep["tokens"] == cache.get_seq_length() and rep["compression_vs_bf16"] > 1


def test_non_mla_model_is_refused():
    with pytest.raises(UnsupportedModelError, match="not an MLA model"):
        QuantMLACache(LlamaConfig(), "c4r4")


def test_update_refuses_non_latent_tensors():
    model = tiny_model("deepseek_v2")
    cache = QuantMLACache(model.config, "c4r4")
    with pytest.raises(ValueError, match="Is this an MLA model"):
        cache.update(torch.randn(1, 4, 3, 64), torch.randn(1, 4, 3, 16), 0)
