"""The two calibration objectives against an independent float64 computation written out here by hand: per query,
the keys the cache policy reads from the packed copy (sink and local window exact), the scaled logits, the softmax,
the per-head values and ``o_proj`` (content); the positional logits over causal pairs (RoPE). The quantizer
(``fake_quantize``, tested on its own) is the only shared piece: it is what the cache stores."""

from __future__ import annotations

import pytest
import torch

from quantmla.calibrate.objectives import content_objective, layer_inputs, rope_objective
from quantmla.calibrate.transforms import ContentTransform, RopeTransform
from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention
from quantmla.quant.quantize import fake_quantize
from quantmla.quant.spec import QuantSpec

S, SINK, LOCAL = 18, 2, 4
CSPEC, RSPEC = QuantSpec(bits=2, group_size=32), QuantSpec(bits=2, group_size=16)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def layer(request):
    model = tiny_model(request.param)
    spec = MLASpec.from_config(model.config)
    _, attn = next(iter_mla_attention(model))
    w = extract_layer_weights(attn)
    h = torch.randn(2, S, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = cos_sin_from_position_embeddings(model.model.rotary_emb(h, torch.arange(S)[None]))
    x = layer_inputs(w, spec, h, cos, sin, sink=SINK, local=LOCAL)
    return x, w, spec, attn


def _read_quantized(t: int, j: int) -> bool:
    """The policy, by hand: query t reads key j from its packed copy unless j is a sink token or one of the last
    ``LOCAL`` tokens up to t."""
    return j <= t and j >= SINK and j <= t - LOCAL


def test_layer_inputs_masks_are_the_policy(layer):
    x = layer[0]
    for t in range(S):
        for j in range(S):
            assert bool(x.mask[t, j]) == (j <= t)
            assert bool(x.quant_mask[t, j]) == _read_quantized(t, j), (t, j)


@pytest.mark.parametrize("sink,local", [(0, 0), (2, 0), (0, 4), (2, 4), (0, 1), (-1, -3)])
@pytest.mark.parametrize("queries", [None, [0], [5, 17], []])
def test_reads_all_is_the_mask_comparison(layer, sink, local, queries):
    """``reads_all`` (decided on the host, so the content objective needs no device read per step) says exactly
    what comparing the two masks on the device says, for every policy and query subset, and survives select/cat."""
    from quantmla.calibrate.objectives import LayerInputs

    _, w, spec, attn = layer
    h = torch.randn(2, S, attn.config.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = torch.ones(1, S, spec.qk_rope_head_dim // 2), torch.zeros(1, S, spec.qk_rope_head_dim // 2)
    qidx = None if queries is None else torch.tensor(queries, dtype=torch.long)
    x = layer_inputs(w, spec, h, cos, sin, qidx, sink=sink, local=local)
    assert x.reads_all == bool(x.quant_mask.eq(x.mask).all())
    both = LayerInputs.cat([x, x])
    assert both.reads_all == x.reads_all and x.select(torch.tensor([1]), None).reads_all == x.reads_all


def _pairs(v: torch.Tensor, pairing: str) -> torch.Tensor:
    """Real [..., Dr] -> complex [..., Dr/2] (float64), by hand for both layouts."""
    v = v.double()
    if pairing == "interleaved":
        return torch.complex(v[..., 0::2], v[..., 1::2])
    h = v.shape[-1] // 2
    return torch.complex(v[..., :h], v[..., h:])


def _unpairs(z: torch.Tensor, pairing: str) -> torch.Tensor:
    if pairing == "interleaved":
        return torch.stack([z.real, z.imag], -1).flatten(-2)
    return torch.cat([z.real, z.imag], -1)


@pytest.mark.parametrize("transform", [False, True])
def test_rope_objective_equals_float64_by_hand(layer, transform):
    x, _, spec, _ = layer
    pairing = spec.rope_cache_pairing
    npairs = x.k_pe.shape[-1] // 2
    g = torch.Generator().manual_seed(1)
    r = None
    if transform:  # a random scale-and-rotation per pair
        r = RopeTransform(npairs, torch.randn(npairs, generator=g) * 0.5, torch.rand(npairs, generator=g) * 6)
    with torch.no_grad():
        got = float(rope_objective(x, spec, r, RSPEC))
    k = x.k_pe.double()  # [B, S, Dr]
    if r is None:
        k_hat = fake_quantize(x.k_pe, RSPEC).double()
    else:
        z = torch.polar(torch.exp(r.log_s.detach().double()), r.phi.detach().double())  # [Dr/2]
        kz = _unpairs(_pairs(k, pairing) * z, pairing)
        k_hat = _unpairs(_pairs(fake_quantize(kz.float(), RSPEC), pairing) / z, pairing)
    q = x.q_pe.double()  # [B, H, T, Dr]
    num = den = 0.0
    B, H = q.shape[:2]
    for b in range(B):
        for h in range(H):
            for t in range(S):
                for j in range(t + 1):
                    den += float(q[b, h, t] @ k[b, j]) ** 2
                    if _read_quantized(t, j):
                        num += float(q[b, h, t] @ (k_hat[b, j] - k[b, j])) ** 2
    assert got == pytest.approx(num / den, rel=1e-4)


@pytest.mark.parametrize("transform", [False, True])
def test_content_objective_equals_float64_by_hand(layer, transform):
    x, w, spec, attn = layer
    dc = x.c.shape[-1]
    t = None
    if transform:
        gain = attn.kv_a_layernorm.weight if hasattr(attn.kv_a_layernorm, "weight") else None
        t = ContentTransform.identity(dc, gain)
        with torch.no_grad():
            t.gen.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
            t.log_v.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = float(content_objective(x, w, spec, t, CSPEC))
        if t is None:
            c_hat = fake_quantize(x.c, CSPEC).double()
        else:
            tm = t.matrix(torch.float64)
            c_hat = fake_quantize(t(x.c), CSPEC).double() @ torch.linalg.inv(tm)  # QDQ(c T) T^-1
    c, kp = x.c.double(), x.k_pe.double()
    q_lat, q_pe = x.q_lat.double(), x.q_pe.double()
    w_uv, o_proj = w.w_uv.double(), w.o_proj.double()  # [H, Dv, Dc], [D, H * Dv]
    B, H = q_lat.shape[:2]

    def output(quantized: bool) -> torch.Tensor:  # [B, S, D]
        out = torch.zeros(B, S, o_proj.shape[0], dtype=torch.float64)
        for b in range(B):
            for tq in range(S):
                keys = torch.stack([c_hat[b, j] if quantized and _read_quantized(tq, j) else c[b, j]
                                    for j in range(tq + 1)])  # fmt: skip
                heads = []
                for h in range(H):
                    logits = (keys @ q_lat[b, h, tq] + kp[b, : tq + 1] @ q_pe[b, h, tq]) * spec.softmax_scale
                    p = torch.softmax(logits, 0)
                    heads.append(w_uv[h] @ (p @ keys))  # [Dv]
                out[b, tq] = o_proj @ torch.cat(heads)
        return out

    ref, noisy = output(False), output(True)
    want = float(((noisy - ref) ** 2).sum() / (ref**2).sum())
    assert got == pytest.approx(want, rel=1e-3)
    assert want > 1e-4  # 2-bit content is visibly lossy: the check is not comparing two zeros
