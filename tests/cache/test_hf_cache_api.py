"""QuantMLACache's transformers API beyond plain generation, through its public interface only (so these tests
hold for any implementation of the cache): beam-search reordering (``reorder_cache``), batch selection
(``batch_select_indices``), and the formats that keep one path unquantized (C4R16, C16R4)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from quantmla.cache.hf import QuantMLACache
from quantmla.compat import with_cache
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.quant.formats import CachePolicy, get_format
from quantmla.quant.quantize import fake_quantize

POLICY = CachePolicy(sink=2, local=3)


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3", first_k_dense_replace=99)  # dense MLPs: no routing flips


def _prefill(model, ids, cache):
    with torch.no_grad():
        return model(ids, use_cache=True, **with_cache(cache)).logits[:, -1]


def _continue(model, cache, tokens):
    """Teacher-forced decode of ``tokens`` [B, n] one step at a time; logits [n, B, V]."""
    out = []
    with torch.no_grad():
        for i in range(tokens.shape[1]):
            out.append(model(tokens[:, i : i + 1], use_cache=True, **with_cache(cache)).logits[:, -1])
    return torch.stack(out)


def _data(model, b=3, t=14, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = model.config.vocab_size
    return torch.randint(0, v, (b, t), generator=g), torch.randint(0, v, (b, n), generator=g)


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4", "bf16"])
def test_reorder_cache_equals_a_cache_built_from_the_reordered_batch(model, fmt):
    """Beam search keeps rows ``beam_idx`` of the cache: afterwards the cache must behave exactly like one that was
    filled with those rows' tokens (packed copies and the full-precision sink/local copies alike)."""
    prompts, nxt = _data(model)
    beam_idx = torch.tensor([2, 0, 0])
    cache = QuantMLACache(model.config, fmt, POLICY)
    _prefill(model, prompts, cache)
    cache.reorder_cache(beam_idx)
    got = _continue(model, cache, nxt)
    ref_cache = QuantMLACache(model.config, fmt, POLICY)
    _prefill(model, prompts[beam_idx], ref_cache)
    want = _continue(model, ref_cache, nxt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == prompts.shape[1] + nxt.shape[1]
    # a reorder that did nothing would be visible: the rows really differ
    stale = QuantMLACache(model.config, fmt, POLICY)
    _prefill(model, prompts, stale)
    assert (_continue(model, stale, nxt)[:, 0] - want[:, 0]).abs().max() > 1e-3


def test_batch_select_indices_keeps_those_rows(model):
    prompts, nxt = _data(model, b=4, seed=1)
    keep = torch.tensor([3, 1])
    cache = QuantMLACache(model.config, "c4r4", POLICY)
    _prefill(model, prompts, cache)
    cache.batch_select_indices(keep)
    ref_cache = QuantMLACache(model.config, "c4r4", POLICY)
    _prefill(model, prompts[keep], ref_cache)
    torch.testing.assert_close(_continue(model, cache, nxt[keep]), _continue(model, ref_cache, nxt[keep]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_beam_search_with_the_bf16_format_equals_transformers_cache(model):
    """transformers' own beam search (it calls reorder_cache every step) gives the same beams as with its
    DynamicCache when our cache stores the latents unquantized."""
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=8, min_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **kw, **with_cache(DynamicCache(config=model.config)))
        got = model.generate(ids, **kw, **with_cache(QuantMLACache(model.config, "bf16", POLICY)))
    assert torch.equal(got, ref)
    assert len({tuple(r.tolist()) for r in ref[:3]}) > 1  # the beams differ, so reordering mattered


@pytest.mark.parametrize("fmt,quantized", [("c4r16", "content"), ("c16r4", "rope"), ("c2r16", "content")])
def test_one_path_unquantized_formats(model, fmt, quantized):
    """C4R16 / C16R4: the named path is quantized exactly as the quantizer does it (for keys read from their
    packed copy), the other path is kept unquantized (BF16 rounding at most), in every layer."""
    spec = MLASpec.from_config(model.config)
    f = get_format(fmt).adapted(spec.kv_lora_rank, spec.qk_rope_head_dim)
    assert (f.content is None) == (quantized == "rope") and (f.rope is None) == (quantized == "content")
    cache = QuantMLACache(model.config, fmt, POLICY)
    g = torch.Generator().manual_seed(5)
    T = 20
    for layer in range(spec.num_cache_layers):
        c = torch.randn(2, 1, T, spec.kv_lora_rank, generator=g)
        r = torch.randn(2, 1, T, spec.qk_rope_head_dim, generator=g)
        c_out, r_out = cache.update(c, r, layer)
        packed = slice(POLICY.sink, T - POLICY.local)  # read from the packed copy by the newest token
        q_in, q_out, spec_q = (c, c_out, f.content) if quantized == "content" else (r, r_out, f.rope)
        e_in, e_out = (r, r_out) if quantized == "content" else (c, c_out)
        torch.testing.assert_close(q_out[..., packed, :], fake_quantize(q_in, spec_q)[..., packed, :], rtol=0, atol=0)
        assert (q_out[..., packed, :] - q_in[..., packed, :]).abs().max() > 1e-2  # really quantized
        torch.testing.assert_close(e_out.float(), e_in, rtol=2**-8, atol=0)  # unquantized path: BF16 at most
        for window in (slice(0, POLICY.sink), slice(T - POLICY.local, T)):  # sink and local: full precision
            torch.testing.assert_close(q_out[..., window, :].float(), q_in[..., window, :], rtol=2**-8, atol=0)


def test_one_path_formats_through_generation(model):
    """End to end: each one-path format perturbs the logits (it is not silently BF16), the RoPE-only one less than
    C4R4, and the content-only one about as much as C4R4 (4-bit content error dominates on this model; errors of
    the two paths do not simply add, so C4R16 may land a little above C4R4)."""
    prompts, nxt = _data(model, b=2, t=30, n=6, seed=6)

    def logits(fmt):
        cache = QuantMLACache(model.config, fmt, POLICY)
        _prefill(model, prompts, cache)
        return _continue(model, cache, nxt)

    ref = logits("bf16")
    err = {f: float(((logits(f) - ref) ** 2).mean() / (ref**2).mean()) for f in ("c4r16", "c16r4", "c4r4")}
    assert 0 < err["c16r4"] < 0.5 * err["c4r4"], err
    assert 0.5 * err["c4r4"] < err["c4r16"] < 1.5 * err["c4r4"], err
