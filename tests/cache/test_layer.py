"""One layer of the paged cache: storage is exact, attention follows the documented policy, bad input is refused."""

import pytest
import torch

from quantmla.cache.hf import QuantMLACache
from quantmla.mla.spec import MLASpec
from quantmla.quant.formats import CachePolicy, get_format
from quantmla.quant.quantize import dequantize_codes, quantize_codes

DC, DR = 128, 64


def spec(layers=1):
    return MLASpec(model_type="deepseek_v3", num_layers=layers, hidden_size=64, num_heads=2, kv_lora_rank=DC,
                   qk_rope_head_dim=DR, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, rope_pairing="half",
                   softmax_scale=0.1, latent_norm=True)  # fmt: skip


def layer(fmt, pol=None, **kw):
    return QuantMLACache(spec(), fmt, pol or CachePolicy(), **kw).mla_layer(0)


def _data(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, DC, generator=g), torch.randn(b, s, DR, generator=g)


def _write_chunks(lay, c, r, chunks):
    i = 0
    for n in chunks:
        lay.write(c[:, i : i + n], r[:, i : i + n])
        i += n


def _qdq(x, spec_):
    return x.double() if spec_ is None else dequantize_codes(*quantize_codes(x, spec_), spec_).double()


def _expected_attention(c, r, q_lat, q_pe, scale, fmt, pol):
    """Independent float64 construction of the policy: per query t, key j is its BF16 copy if j < sink or
    j > t - local, else its quantize-dequantize (an unquantized path is BF16); then plain causal softmax."""
    b, s, _ = c.shape
    t = q_lat.shape[2]
    cq, rq = _qdq(c, fmt.content), _qdq(r, fmt.rope)
    cq = c.bfloat16().double() if fmt.content is None else cq
    rq = r.bfloat16().double() if fmt.rope is None else rq
    out = torch.zeros(b, q_lat.shape[1], t, c.shape[-1], dtype=torch.float64)
    for i in range(t):
        pos = s - t + i
        full = torch.tensor([(j < pol.sink) or (j > pos - pol.local) for j in range(pos + 1)])
        if not fmt.is_quantized:
            full[:] = True
        ck = torch.where(full[None, :, None], c[:, : pos + 1].bfloat16().double(), cq[:, : pos + 1])
        rk = torch.where(full[None, :, None], r[:, : pos + 1].bfloat16().double(), rq[:, : pos + 1])
        sc = (torch.einsum("bhd,bsd->bhs", q_lat[:, :, i].double(), ck)
              + torch.einsum("bhd,bsd->bhs", q_pe[:, :, i].double(), rk)) * scale
        out[:, :, i] = torch.einsum("bhs,bsd->bhd", sc.softmax(-1), ck)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "c8r8", "c4r4", "c2r4", "c4r8", "c4r16", "c16r4"])
@pytest.mark.parametrize("pol", [CachePolicy(4, 8, 16), CachePolicy(0, 5, 16), CachePolicy(2, 0, 16),
                                 CachePolicy(3, 40, 16)])  # fmt: skip
@pytest.mark.parametrize("chunks", [[23], [9, 1, 1, 12], [1] * 5 + [18], [20, 1]])
def test_attention_follows_the_policy(fmt, pol, chunks):
    fmt = get_format(fmt)
    c, r = _data(2, sum(chunks), seed=len(chunks))
    lay = layer(fmt, pol)
    _write_chunks(lay, c, r, chunks[:-1])
    t = chunks[-1]
    lay.write(c[:, -t:], r[:, -t:])
    q_lat, q_pe = torch.randn(2, 3, t, DC), torch.randn(2, 3, t, DR)
    got = lay.attend(q_lat, q_pe, 0.07)
    ref = _expected_attention(c, r, q_lat, q_pe, 0.07, fmt, pol)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4"])
def test_prefill_equals_token_by_token_decode(fmt):
    # Two code paths (the chunked prefill with its `recent` window, and decode over the ring buffer) must agree.
    pol = CachePolicy(4, 6, 16)
    c, r = _data(1, 30, seed=3)
    q_lat, q_pe = torch.randn(1, 2, 30, DC), torch.randn(1, 2, 30, DR)
    a = layer(fmt, pol)
    a.write(c, r)
    prefill = a.attend(q_lat, q_pe, 0.1)
    b = layer(fmt, pol)
    steps = []
    for i in range(30):
        b.write(c[:, i : i + 1], r[:, i : i + 1])
        steps.append(b.attend(q_lat[:, :, i : i + 1], q_pe[:, :, i : i + 1], 0.1))
    # Same codes, same policy; only the fp32 summation order differs (a policy slip would differ by ~1e-1).
    torch.testing.assert_close(prefill, torch.cat(steps, dim=2), rtol=1e-4, atol=1e-5)
    # ... and both are the policy itself (independent float64 construction), not merely equal to each other
    torch.testing.assert_close(prefill.double(), _expected_attention(c, r, q_lat, q_pe, 0.1, get_format(fmt), pol),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("chunks", [[50], [3, 1, 1, 45], [7] * 7 + [1]])
def test_every_token_quantized_exactly_once(chunks):
    # The packed copies equal quantizing the whole sequence at once, bit for bit, whatever the chunking.
    fmt = get_format("c4r4")
    c, r = _data(2, sum(chunks), seed=5)
    lay = layer(fmt, CachePolicy(4, 16, 16))
    _write_chunks(lay, c, r, chunks)
    lay.flush()
    want = torch.cat([_qdq(c, fmt.content), _qdq(r, fmt.rope)], -1).float()
    for b in range(2):
        torch.testing.assert_close(lay.view.read_packed(b, torch.arange(50)), want[b], rtol=0, atol=0)


def test_read_is_the_newest_token_view():
    fmt, pol = get_format("c2r4"), CachePolicy(2, 5, 16)
    c, r = _data(1, 20, seed=7)
    lay = layer(fmt, pol)
    _write_chunks(lay, c, r, [11, 1, 8])
    rc, rr = lay.read()
    cq = _qdq(c, fmt.content).float()
    protected = [0, 1] + list(range(15, 20))
    for j in range(20):
        want = c[:, j].bfloat16().float() if j in protected else cq[:, j]
        torch.testing.assert_close(rc[:, j], want, rtol=0, atol=0)
    assert torch.equal(rr[:, 17], r[:, 17].bfloat16().float())


def test_bf16_format_stores_bf16():
    lay = layer("bf16")
    c, r = _data(2, 9)
    _write_chunks(lay, c, r, [4, 5])
    rc, rr = lay.read()
    assert rc.dtype == torch.float32
    assert torch.equal(rc, c.bfloat16().float()) and torch.equal(rr, r.bfloat16().float())


def test_bad_writes_raise_clear_errors():
    lay = layer("c4r4")
    c, r = _data(2, 4)
    with pytest.raises(ValueError, match=r"\[B, T, Dc\]"):
        lay.write(c[0], r[0])
    with pytest.raises(ValueError, match="disagree"):
        lay.write(c, r[:, :3])
    with pytest.raises(TypeError, match="share a dtype"):
        lay.write(c, r.double())
    with pytest.raises(TypeError, match="floating point"):
        lay.write(c.int(), r.int())
    with pytest.raises(ValueError, match="widths"):
        lay.write(torch.randn(2, 1, 256), torch.randn(2, 1, 64))
    with pytest.raises(ValueError, match="does not divide"):
        QuantMLACache(MLASpec(**{**spec().to_dict(), "kv_lora_rank": 96}), "c4r4")
    lay.write(c, r)
    lay.flush()
    with pytest.raises(ValueError, match="batch 2"):
        lay.write(c[:1], r[:1])
    with pytest.raises(TypeError, match="holds torch.float32"):
        lay.write(c.half(), r.half())
    with pytest.raises(ValueError, match="write the new tokens"):
        lay.attend(torch.randn(2, 1, 9, DC), torch.randn(2, 1, 9, DR), 0.1)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        lay.attend(torch.randn(2, 9, DC), torch.randn(2, 9, DR), 0.1)
    lay.write(c, r)
    with pytest.raises(ValueError, match="last write held 4"):
        lay.attend(torch.randn(2, 1, 3, DC), torch.randn(2, 1, 3, DR), 0.1)
    assert lay.get_seq_length() == 8  # the write was stored before the error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_write_on_another_device_is_refused():
    lay = layer("c4r4")
    c, r = _data(1, 4)
    lay.write(c, r)
    lay.flush()
    with pytest.raises(ValueError, match="lives on cpu"):
        lay.write(c.cuda(), r.cuda())


@pytest.mark.parametrize("fmt", ["bf16", "c4r4", "c2r4"])
@pytest.mark.parametrize("chunks", [[23], [9, 1, 1, 12], [20, 1]])
def test_per_head_attend_is_w_uv_times_the_policy(fmt, chunks):
    """attend(..., heads=(q_nope, W_UK, W_UV)) returns W_UV o_lat for the absorbed query q_nope W_UK (prefill
    chunks run per head, a single token expands the decode output), against the float64 policy construction."""
    pol = CachePolicy(4, 8, 16)
    c, r = _data(2, sum(chunks), seed=len(chunks))
    lay = layer(fmt, pol)
    _write_chunks(lay, c, r, chunks[:-1])
    t = chunks[-1]
    lay.write(c[:, -t:], r[:, -t:])
    g = torch.Generator().manual_seed(9)
    q_nope, q_pe = torch.randn(2, 3, t, 16, generator=g), torch.randn(2, 3, t, DR, generator=g)
    w_uk, w_uv = torch.randn(3, 16, DC, generator=g) / DC**0.5, torch.randn(3, 24, DC, generator=g) / DC**0.5
    q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)
    got = lay.attend(q_lat, q_pe, 0.07, heads=(q_nope, w_uk, w_uv))
    ref = torch.einsum("bhtc,hvc->bhtv", _expected_attention(c, r, q_lat, q_pe, 0.07, get_format(fmt), pol),
                       w_uv.double())  # fmt: skip
    assert got.shape == (2, 3, t, 24)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_one_mask_check_per_forward_and_never_a_stale_answer():
    """Every layer of a forward gets views of one mask: the check runs once and the other layers reuse its answer
    (the same answer a fresh check gives). A mask changed in place, another mask tensor (even with the same
    content, even after the first is freed), other shapes or pads: checked again, so a hole in a new mask is
    always seen (a reused answer there would be a silent wrong result)."""
    cache = QuantMLACache(spec(layers=3), "c4r4", CachePolicy())
    c, r = _data(2, 40)
    for i in range(3):
        cache.mla_layer(i).write(c, r)
        cache.mla_layer(i).attend(torch.randn(2, 2, 40, DC), torch.randn(2, 2, 40, DR), 0.1)
    store = cache.mla_layer(0).store
    B, T, S = 2, 4, 44
    qpos = torch.arange(S - T, S)[:, None]
    full = (torch.arange(S + 8)[None, :] <= qpos)[None, None].expand(B, 1, T, S + 8)  # transformers' [.., S + spare]
    before = store.mask_checks
    for i in range(3):  # one forward: each layer slices the same tensor
        assert cache.mla_layer(i)._pads_and_causal(full[..., :S], B, T, S, first=False) == ([0, 0], True)
    assert store.mask_checks == before + 1
    full2 = full.clone()  # same content, another tensor
    assert cache.mla_layer(0)._pads_and_causal(full2[..., :S], B, T, S, first=False) == ([0, 0], True)
    assert store.mask_checks == before + 2
    full2[0, 0, 1, 3] = False  # changed in place: a hole
    assert cache.mla_layer(1)._pads_and_causal(full2[..., :S], B, T, S, first=False) == ([0, 0], False)
    assert cache.mla_layer(1).last_mask_causal is False
    assert cache.mla_layer(2)._pads_and_causal(full2[..., :S], B, T, S, first=False) == ([0, 0], False)
    assert store.mask_checks == before + 3
    del full, full2
    for _ in range(5):  # new masks, possibly at the freed addresses: each one checked
        hole = (torch.arange(S)[None, :] <= qpos)[None, None].expand(B, 1, T, S).clone()
        hole[1, 0, 0, 0] = False
        assert cache.mla_layer(0)._pads_and_causal(hole, B, T, S, first=False) == ([0, 0], False)
        del hole
    assert store.mask_checks == before + 8
