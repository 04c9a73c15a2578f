"""The captured decode step (quantmla.cache.graph): its preconditions are clear errors on any machine; on CUDA its
tokens and logits are the eager step's, step after step, across page and local-window boundaries."""

import pytest
import torch

from quantmla.cache.graph import CapturedDecode, decode_step
from quantmla.cache.hf import QuantMLACache
from quantmla.compat import with_cache
from quantmla.mla.attention import enable_absorbed_attention
from quantmla.mla.tiny import tiny_model
from quantmla.quant.formats import CachePolicy

POLICY = CachePolicy(sink=4, local=16, page_size=64)


def _prefilled(fmt, device, B=2, n=40, max_length=None, model=None):
    model = model or enable_absorbed_attention(tiny_model("deepseek_v3", first_k_dense_replace=99)).to(device)
    ids = torch.randint(0, model.config.vocab_size, (B, n), generator=torch.Generator().manual_seed(4)).to(device)
    cache = QuantMLACache(model.config, fmt, POLICY, max_length=max_length)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **with_cache(cache)).logits[:, -1]
    return model, cache, logits


def test_preconditions_are_clear_errors():
    model = enable_absorbed_attention(tiny_model("deepseek_v3", first_k_dense_replace=99))
    empty = QuantMLACache(model.config, "c4r4", POLICY, max_length=64)
    with pytest.raises(ValueError, match="the cache is empty"):
        CapturedDecode(model, empty)
    model, cache, _ = _prefilled("c4r4", "cpu", max_length=64, model=model)
    with pytest.raises(ValueError, match="needs the cache on a CUDA device"):
        CapturedDecode(model, cache)


def test_a_layer_without_gpu_kernels_is_refused():
    """Where decode or write would run the torch reference (here: a CPU cache), capturing is refused: its loops
    over the host's lengths would be frozen into the graph."""
    from quantmla.cache.graph import _check_kernels

    _, cache, _ = _prefilled("c4r4", "cpu", max_length=64)
    views = [cache.store.layer(i) for i in range(len(cache.store.layouts))]
    with pytest.raises(ValueError, match="layer 0 .*has no GPU decode kernel here"):
        _check_kernels(views)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["bf16", "c4r4", "c2r4", "c4r4t"])
def test_gpu_captured_steps_equal_eager_steps(fmt):
    """40-token prompts, 40 greedy steps (over the page boundary at 64 and around the 16-token local ring): the
    captured step replayed against the eager step on a copy of the same cache, its splits planned for the same
    capacity (so both launch the same kernels with the same plan): the same tokens, logits within 1e-4."""
    model, cache_g, first = _prefilled(fmt, "cuda", max_length=128)
    _, cache_e, _ = _prefilled(fmt, "cuda", max_length=128, model=model)
    for i in range(len(cache_e.store.layouts)):
        cache_e.store.layer(i).planned_length = 128
    graph = CapturedDecode(model, cache_g)
    tok_g = tok_e = first.argmax(-1, keepdim=True)
    for step in range(40):
        lg = graph.step(tok_g)
        with torch.no_grad():
            le = decode_step(model, cache_e, tok_e, torch.tensor([40 + step], device="cuda")).float()
        assert torch.allclose(lg, le, atol=1e-4, rtol=1e-4), (step, float((lg - le).abs().max()))
        tok_g, tok_e = lg.argmax(-1, keepdim=True), le.argmax(-1, keepdim=True)
        assert torch.equal(tok_g, tok_e), step
    assert graph.length == 80 and cache_g.store.layer(0).lengths() == [80, 80]
    assert torch.equal(cache_g.store.layer(0).seq_lens.cpu(), torch.tensor([80, 80], dtype=torch.int32))
    for i in range(len(cache_g.store.layouts)):  # the pages and BF16 buffers hold the same bytes
        g, e = cache_g.store.layer(i), cache_e.store.layer(i)
        assert torch.equal(g.local, e.local) and torch.equal(g.sink, e.sink)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_greedy_generate_equals_the_models_own_eager_steps():
    """greedy_generate (prompt eagerly, then replays) gives the greedy tokens of transformers' own forward called
    step by step (positions and mask computed by the model, not by decode_step) on a cache planned for the same
    capacity. (model.generate plans each step's splits for the current length instead: its rounding differs, and a
    random tiny model's near-ties then flip -- seen on the H200, 2026-12-01.)"""
    from quantmla.cache.graph import greedy_generate

    model = enable_absorbed_attention(tiny_model("deepseek_v3", first_k_dense_replace=99)).to("cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(6)).to("cuda")
    cache = QuantMLACache(model.config, "c4r4", POLICY, max_length=74)
    out = [ids]
    with torch.no_grad():
        x = ids
        for step in range(24):
            logits = model(input_ids=x, use_cache=True, logits_to_keep=1, **with_cache(cache)).logits[:, -1]
            if step == 0:
                for i in range(len(cache.store.layouts)):
                    cache.store.layer(i).planned_length = 74
            x = logits.argmax(-1, keepdim=True)
            out.append(x)
    ref = torch.cat(out, dim=1)
    got = greedy_generate(model, ids, QuantMLACache(model.config, "c4r4", POLICY, max_length=74), 24)
    assert got.shape == (2, 74)
    assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_capacity_and_shape_errors():
    model, cache, first = _prefilled("c4r4", "cuda", max_length=42)
    graph = CapturedDecode(model, cache)
    tok = first.argmax(-1, keepdim=True)
    with pytest.raises(ValueError, match="input_ids must be"):
        graph.step(tok[:1])
    graph.step(tok)
    graph.step(tok)
    with pytest.raises(ValueError, match="reached max_length=42"):
        graph.step(tok)


def test_trusted_causal_mask_is_trusted_only_after_the_first_write():
    """While a step is captured its layers trust the decode mask (the warm-up step checked it: a capture cannot read
    the mask on the host); a first write, which learns the padding from the mask, is checked whatever the flag."""
    _, cache, _ = _prefilled("c4r4", "cpu", max_length=64)
    layer = cache.layers[0].mla
    B, T, S = 2, 1, 41
    causal = torch.ones(B, 1, T, S, dtype=torch.bool)
    hole = causal.clone()
    hole[:, :, :, 7] = False  # not plain causal attention
    assert layer._pads_and_causal(causal, B, T, S, first=False) == ([0, 0], True)
    assert layer.last_mask_causal is True
    assert layer._pads_and_causal(hole, B, T, S, first=False) == ([0, 0], False)
    assert layer.last_mask_causal is False
    layer.trust_causal_mask = True
    assert layer._pads_and_causal(hole, B, T, S, first=False) == ([0, 0], True)
    assert layer._pads_and_causal(hole, B, T, S, first=True)[1] is False
    with pytest.raises(ValueError, match="attention mask must be bool"):
        layer._pads_and_causal(causal[:, :, :, :-1], B, T, S, first=False)  # shapes are checked even when trusted
