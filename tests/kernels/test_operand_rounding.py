"""Simulated tensor-core operand rounding (operand_rounding.py) against float64 math: each scheme rounds what it
says to the precision it says, the references return the rounded result only inside the context (bit-identical
outside it), and the measured errors are the rounded-vs-exact errors."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import make_cache

from quantmla.kernels.operand_rounding import (
    P_SCALE,
    SCHEMES,
    round_probs,
    round_query,
    rounded_attention,
    simulated_operand_rounding,
)
from quantmla.kernels.reference import decode_attention_torch, prefill_attention_torch
from quantmla.quant.formats import CachePolicy

DC, DR = 128, 32


def _q(seed=0, rows=6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, DC + DR, generator=g) * torch.logspace(-2, 1, DC + DR)[torch.randperm(DC + DR, generator=g)]
    q[0, :64] = 0.0  # an all-zero group stays zero
    return q


def _group_ranges():
    return [(0, 64), (64, 128), (128, 144), (144, 160)]  # content groups of 64, RoPE groups of 16


@pytest.mark.parametrize("scheme", ["e4m3", "int8-q", "int8x2-q"])
def test_8bit_query_rounding_is_per_group_and_within_its_precision(scheme):
    q = _q()
    r = round_query(q, DC, 64, 16, scheme=scheme)
    for a, b in _group_ranges():
        g, rg = q[:, a:b].double(), r[:, a:b].double()
        amax = g.abs().amax(-1, keepdim=True)
        if scheme == "int8-q":  # uniform grid of amax / 127: half a step at most
            assert ((rg - g).abs() <= amax / 127 / 2 * (1 + 1e-6) + 1e-30).all()
        elif scheme == "int8x2-q":  # two terms: one step of the grid amax / 127 / 256 (a residual of 128 clips to 127)
            assert ((rg - g).abs() <= amax / 127 / 256 * (1 + 1e-4) + 1e-30).all()
            one = round_query(q, DC, 64, 16, scheme="int8-q")[:, a:b].double()
            assert (rg - g).abs().sum() < (one - g).abs().sum() / 64  # far finer than one int8 term
        else:  # e4m3: 3 mantissa bits -> relative error <= 2^-4 above the subnormal range (|x| >= 2^-6 of the step)
            normal = g.abs() >= amax / 448 * 2**-6
            rel = ((rg - g).abs() / g.abs().clamp_min(1e-30))[normal]
            assert (rel <= 2**-4 * (1 + 1e-6)).all()
            assert ((rg - g).abs()[~normal] <= amax.expand_as(g)[~normal] / 448 * 2**-10 * (1 + 1e-6)).all()
        assert torch.allclose(rg.abs().amax(-1, keepdim=True), amax, rtol=1e-6, atol=0)  # the group maximum: exact
    assert (r[0, :64] == 0).all() and not r.isnan().any()
    assert (r != q).any()  # something was rounded


def test_bf16_and_fp32_schemes():
    q = _q()
    assert torch.equal(round_query(q, DC, 64, 16, scheme="fp32"), q)
    assert torch.equal(round_query(q, DC, 64, 16, scheme="bf16"), q.bfloat16().float())
    p = torch.rand(4, 50)
    assert torch.equal(round_probs(p, scheme="e4m3-q"), p.bfloat16().float())  # its output product is 16-bit


def test_e4m3_probabilities_keep_small_numerators():
    p = torch.tensor([1.0, 0.5, 2.0**-12, 2.0**-16, 2.0**-20])
    r = round_probs(p, scheme="e4m3")
    assert torch.equal(r[:4], p[:4])  # powers of two above 2^-17: exact after the x256 scale
    assert r[4] == 0  # below 2^-17 (2^-9 of e4m3 / 256): flushed
    x = torch.rand(1000, dtype=torch.float64) * 0.9 + 0.1  # normals: relative error <= 2^-4
    assert ((round_probs(x.float(), scheme="e4m3").double() - x).abs() / x <= 2**-4 * (1 + 1e-6)).all()
    assert P_SCALE * 1.0 <= 448


def test_int8_probabilities_are_rounded_per_64_key_tile():
    g = torch.Generator().manual_seed(3)
    # rows of 150 keys: tiles [0, 64), [64, 128) and a short [128, 150); tile maxima far apart within a row
    tile_top = torch.tensor([1.0, 1e-3, 0.3]).repeat_interleave(torch.tensor([64, 64, 22]))
    p = torch.rand(4, 150, generator=g, dtype=torch.float64) * tile_top
    p[1, 64:128] = 0.0  # an all-zero tile stays zero
    r = round_probs(p.float(), scheme="int8-p").double()
    for a, b in ((0, 64), (64, 128), (128, 150)):
        t, rt = p[:, a:b], r[:, a:b]
        step = t.amax(-1, keepdim=True) / 127  # the tile's own grid, whatever the other tiles hold
        assert ((rt - t).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all()
        k = rt / step.clamp_min(1e-300)
        assert torch.allclose(k, k.round(), atol=1e-3)  # on the grid: integers 0 .. 127
    assert (r[1, 64:128] == 0).all() and not r.isnan().any() and (r >= 0).all()
    assert (r != p.float().double()).any()
    q = _q()
    assert torch.equal(round_query(q, DC, 64, 16, scheme="int8-p"), q.bfloat16().float())  # a 16-bit score product


def _attention64(q, keys, scale, allowed, dc):
    s = (q.double() @ keys.double().T) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ keys.double()[:, :dc]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rounded_attention_matches_float64_math_on_rounded_operands(scheme):
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(5, DC + DR, generator=g), torch.randn(40, DC + DR, generator=g)
    allowed = torch.rand(5, 40, generator=g) > 0.3
    allowed[2] = False  # a row with nothing allowed gives 0
    with simulated_operand_rounding(scheme, measure=True) as st:
        out = rounded_attention(q, keys, 0.1, allowed, DC, (64, 16))
    # the independent reconstruction: float64 softmax with q rounded as the scheme does and p's rounding applied to
    # the exp(s - max) numerators, the sums exact
    qr = round_query(q, DC, 64, 16, scheme=scheme).double()
    s = (qr @ keys.double().T * 0.1).masked_fill(~allowed, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0))
    want = (round_probs(e.float(), scheme=scheme).double() @ keys.double()[:, :DC]) / e.sum(-1, keepdim=True)
    want = want.nan_to_num(0.0)
    assert (out[2] == 0).all() and not out.isnan().any()
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6)
    exact = _attention64(q, keys, 0.1, allowed, DC)
    err = ((out.double() - exact).norm() / exact.norm()).item()
    if scheme == "fp32":
        assert err < 1e-6 and st.summary()["calls"] == 0
    else:
        assert 1e-5 < err < 0.1  # rounded, and not wildly
        assert st.summary()["calls"] == 1 and st.rel_l2[0] == pytest.approx(err, rel=1e-3)


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="e4m3"):
        with simulated_operand_rounding("fp8"):
            pass
    with pytest.raises(ValueError, match="e4m3"):
        round_query(_q(), DC, 64, 16, scheme="fp8")  # never silently some other rounding
    with pytest.raises(ValueError, match="e4m3"):
        round_probs(torch.rand(3), scheme="int4")


@pytest.mark.parametrize("name", ["c4r4", "bf16"])
def test_references_round_only_inside_the_context(name):
    policy = CachePolicy(sink=4, local=16, page_size=16)
    lens = [0, 9, 40, 77]
    cache, _, _ = make_cache(name, lens, dc=DC, dr=DR, policy=policy, seed=3, device="cpu")
    g = torch.Generator().manual_seed(4)
    ql, qp = torch.randn(len(lens), 4, DC, generator=g), torch.randn(len(lens), 4, DR, generator=g)
    before = decode_attention_torch(ql, qp, cache, 0.1)
    with simulated_operand_rounding("fp32"):
        assert torch.equal(decode_attention_torch(ql, qp, cache, 0.1), before)
    with simulated_operand_rounding("e4m3", measure=True) as st:
        rounded = decode_attention_torch(ql, qp, cache, 0.1)
    assert torch.equal(decode_attention_torch(ql, qp, cache, 0.1), before)  # the context is gone
    assert st.summary()["calls"] == 3  # one per non-empty sequence
    for b, n in enumerate(lens):
        if n:
            err = ((rounded[b] - before[b]).norm() / before[b].norm()).item()
            assert 0 < err < 0.1
    assert (rounded[0] == 0).all()
    # prefill: the T newest tokens of every sequence, same context rule
    T = 1  # (more new tokens than one need the BF16 rows of the ring's overwritten positions: recent=)
    ql4, qp4 = torch.randn(len(lens), 4, T, DC, generator=g), torch.randn(len(lens), 4, T, DR, generator=g)
    n_new = [min(T, n) for n in lens]
    before = prefill_attention_torch(ql4, qp4, cache, 0.1, n_new)
    with simulated_operand_rounding("int8-q", measure=True) as st:
        rounded = prefill_attention_torch(ql4, qp4, cache, 0.1, n_new)
    assert st.summary()["calls"] == 3 and 0 < max(st.rel_l2) < 0.1
    assert not torch.equal(rounded, before)
    assert torch.equal(prefill_attention_torch(ql4, qp4, cache, 0.1, n_new), before)
