"""``benchmarks/error_split.py``'s configurations on a tiny random MLA model, each against a reference that does not
go through our cache: the model's own forward (transformers' attention, no cache) with the content latent
quantize-dequantized by a forward hook on ``kv_a_layernorm`` (the tensor the cache stores as ``c_kv``).

Not asserted, because it is not true in general: that the content-only or RoPE-only KL is at most the both-paths
KL. The two paths' errors need not add: on the tiny deepseek_v3 model without a BF16 window the content-only KL is
3.69e-3 and the both-paths KL 3.64e-3."""

from __future__ import annotations

import copy

import pytest
import torch

from benchutil import load_benchmark

CONTEXT = 256


def _module():
    return load_benchmark("error_split")


@pytest.fixture(scope="module")
def setup():
    from quantmla.eval.perplexity import reference_logprobs
    from quantmla.mla.tiny import tiny_model

    model = tiny_model("deepseek_v3")  # fp32, 2 layers, latent 128, RoPE key 32
    ids = torch.randint(0, model.config.vocab_size, (2 * CONTEXT,), generator=torch.Generator().manual_seed(0))
    ref = reference_logprobs(copy.deepcopy(model), ids, context=CONTEXT)
    return _module(), model, ids, ref


def _latent_qdq_logprobs(model, ids, layers):
    """Log-probs of ``model``'s own forward (no cache) with every token's content latent QDQ'd to C4R4's content
    spec in ``layers`` (rounded to BF16 in the others): what a cache holding only the content path at 4 bits, read
    without any BF16 window, gives. A cache with a quantized layer stores its BF16 layers and paths as BF16 (the
    byte accounting), also under an fp32 model; the RoPE keys' BF16 rounding is not reproduced here (float
    rounding: the bound below)."""
    from quantmla.quant.formats import get_format
    from quantmla.quant.quantize import fake_quantize

    m = copy.deepcopy(model)
    spec = get_format("c4r4").adapted(m.config.kv_lora_rank, m.config.qk_rope_head_dim).content
    for i, layer in enumerate(m.model.layers):
        qdq = (lambda out: fake_quantize(out, spec)) if i in layers else (lambda out: out.bfloat16().to(out.dtype))
        layer.self_attn.kv_a_layernorm.register_forward_hook(lambda mod, x, out, f=qdq: f(out))
    with torch.no_grad():
        wins = [ids[w * CONTEXT : (w + 1) * CONTEXT][None] for w in range(ids.numel() // CONTEXT)]
        return torch.stack([m(x, use_cache=False).logits[0].float().log_softmax(-1) for x in wins])


def test_bf16_is_the_reference(setup):
    es, model, ids, ref = setup
    r = es.score(copy.deepcopy(model), {"t": (ids, ref)}, "bf16", context=CONTEXT)["t"]
    assert 0 <= r["kl"] < 1e-5  # KL of a distribution to itself, up to float rounding (measured 2.5e-7)
    # a one-layer name whose layer is BF16 too: every layer BF16, the same cache
    one = es.score(copy.deepcopy(model), {"t": (ids, ref)}, es.layer_format(1, "bf16"), context=CONTEXT)["t"]
    assert one == r


@pytest.mark.parametrize("layers", [(0, 1), (1,)])
def test_content_only_is_the_latent_qdq(setup, layers):
    """C4R16 without a BF16 window (sink 0, local 0: every key read from its packed copy) equals the forward with
    the content latent QDQ'd (in every layer, or through :func:`layer_format` in one), while BF16 is far from it."""
    es, model, ids, _ = setup
    hooked = {"t": (ids, _latent_qdq_logprobs(model, ids, layers))}
    content, _, _ = es.CONFIGS["content"]
    _, sink, local = es.CONFIGS["no-window"]
    fmt = content if len(layers) == 2 else es.layer_format(layers[0], content)
    same = es.score(copy.deepcopy(model), hooked, fmt, sink, local, CONTEXT)["t"]["kl"]
    far = es.score(copy.deepcopy(model), hooked, "bf16", sink, local, CONTEXT)["t"]["kl"]
    assert same < 1e-5  # float rounding, as for BF16 against the model itself (measured 5e-7 / 7e-7)
    mix = f"mix:{content}@{','.join(map(str, layers))}:bf16"  # hot-r8's kind of name: these layers, BF16 elsewhere
    assert es.score(copy.deepcopy(model), hooked, mix, sink, local, CONTEXT)["t"]["kl"] < 1e-5
    inverse = f"mix:bf16@{','.join(map(str, layers))}:{content}"  # the other layers quantized instead
    assert es.score(copy.deepcopy(model), hooked, inverse, sink, local, CONTEXT)["t"]["kl"] > 100 * same
    assert far > 100 * same
    if len(layers) == 1:  # the other layer quantized instead: as far as BF16
        other = es.score(copy.deepcopy(model), hooked, es.layer_format(1 - layers[0], content), sink, local,
                         CONTEXT)["t"]  # fmt: skip
        assert other["kl"] > 100 * same


def test_window_covers_short_windows(setup):
    """With a window of sink + local tokens no query reads a packed copy (query t reads token j packed iff
    sink <= j <= t - local): every config's KL is BF16's; the no-window config on the same tokens is not."""
    es, model, ids, ref = setup
    sink, local = 4, CONTEXT - 4
    base = es.score(copy.deepcopy(model), {"t": (ids, ref)}, "bf16", sink, local, CONTEXT)["t"]["kl"]
    for fmt in [f for f, _, _ in es.CONFIGS.values()] + [es.layer_format(0, "c2r4")]:
        kl = es.score(copy.deepcopy(model), {"t": (ids, ref)}, fmt, sink, local, CONTEXT)["t"]["kl"]
        assert kl == pytest.approx(base, rel=1e-6, abs=1e-9)
    fmt, s, loc = es.CONFIGS["no-window"]
    assert es.score(copy.deepcopy(model), {"t": (ids, ref)}, fmt, s, loc, CONTEXT)["t"]["kl"] > 100 * base
