"""The dual-path cache layer: storage is exact, the mixed-precision policy is the documented one."""

import pytest
import torch

from quantmla.cache.dual_path import DualPathLayer
from quantmla.quant.formats import CachePolicy, get_format
from quantmla.quant.packing import unpack
from quantmla.quant.quantize import dequantize_codes, quantize_codes

DC, DR = 128, 64


def _data(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, DC, generator=g), torch.randn(b, s, DR, generator=g)


def _write_chunks(layer, c, r, chunks):
    i = 0
    for n in chunks:
        layer.write(c[:, i : i + n], r[:, i : i + n])
        i += n


def _expected_attention(c, r, q_lat, q_pe, scale, fmt, pol):
    """Independent float64 construction of the policy: per query t, key j is the original value if
    j < sink or j > t - local, else its quantize-dequantize; then plain causal softmax attention."""
    b, s, _ = c.shape
    t = q_lat.shape[2]
    qdq = lambda x, spec: x.double() if spec is None else dequantize_codes(*quantize_codes(x, spec), spec).double()  # noqa: E731
    cq, rq = qdq(c, fmt.content), qdq(r, fmt.rope)
    out = torch.zeros(b, q_lat.shape[1], t, c.shape[-1], dtype=torch.float64)
    for i in range(t):
        pos = s - t + i
        full = torch.tensor([(j < pol.sink) or (j > pos - pol.local) for j in range(pos + 1)])
        if not fmt.is_quantized:
            full[:] = True
        ck = torch.where(full[None, :, None], c[:, : pos + 1].double(), cq[:, : pos + 1])
        rk = torch.where(full[None, :, None], r[:, : pos + 1].double(), rq[:, : pos + 1])
        sc = (torch.einsum("bhd,bsd->bhs", q_lat[:, :, i].double(), ck)
              + torch.einsum("bhd,bsd->bhs", q_pe[:, :, i].double(), rk)) * scale
        out[:, :, i] = torch.einsum("bhs,bsd->bhd", sc.softmax(-1), ck)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "c8r8", "c4r4", "c2r4", "c4r8"])
@pytest.mark.parametrize("pol", [CachePolicy(4, 8), CachePolicy(0, 5), CachePolicy(2, 0), CachePolicy(3, 40)])
@pytest.mark.parametrize("chunks", [[23], [9, 1, 1, 12], [1] * 5 + [18]])
def test_attention_follows_the_policy(fmt, pol, chunks):
    fmt = get_format(fmt)
    c, r = _data(2, sum(chunks), seed=len(chunks))
    layer = DualPathLayer(fmt, pol)
    _write_chunks(layer, c, r, chunks[:-1])
    t = chunks[-1]
    layer.write(c[:, -t:], r[:, -t:])
    q_lat, q_pe = torch.randn(2, 3, t, DC), torch.randn(2, 3, t, DR)
    got = layer.attend(q_lat, q_pe, 0.07)
    ref = _expected_attention(c, r, q_lat, q_pe, 0.07, fmt, pol)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4"])
def test_prefill_equals_token_by_token_decode(fmt):
    fmt, pol = get_format(fmt), CachePolicy(4, 6)
    c, r = _data(1, 30, seed=3)
    q_lat, q_pe = torch.randn(1, 2, 30, DC), torch.randn(1, 2, 30, DR)
    a = DualPathLayer(fmt, pol)
    a.write(c, r)
    prefill = a.attend(q_lat, q_pe, 0.1)
    b = DualPathLayer(fmt, pol)
    steps = []
    for i in range(30):
        b.write(c[:, i : i + 1], r[:, i : i + 1])
        steps.append(b.attend(q_lat[:, :, i : i + 1], q_pe[:, :, i : i + 1], 0.1))
    # Same codes, same policy; only the fp32 summation order differs (a policy slip would differ by ~1e-1).
    torch.testing.assert_close(prefill, torch.cat(steps, dim=2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunks", [[50], [3, 1, 1, 45], [7] * 7 + [1]])
def test_every_token_quantized_exactly_once(chunks):
    # The packed store equals quantizing the whole sequence at once, bit for bit, whatever the chunking.
    fmt = get_format("c4r4")
    c, r = _data(2, sum(chunks), seed=5)
    layer = DualPathLayer(fmt, CachePolicy(4, 16))
    _write_chunks(layer, c, r, chunks)
    codes, scale, offset = quantize_codes(c, fmt.content)
    assert torch.equal(unpack(layer.packed_c.codes.data, 4, DC), codes)
    assert torch.equal(layer.packed_c.scale.data, scale) and torch.equal(layer.packed_c.offset.data, offset)
    codes_r, _, _ = quantize_codes(r, fmt.rope)
    assert torch.equal(unpack(layer.packed_r.codes.data, 4, DR), codes_r)
    # the working copy attention reads is exactly the dequantized packed store
    c_deq, r_deq = layer.dequantized()
    assert torch.equal(c_deq, layer.packed_c.dequantize()) and torch.equal(r_deq, layer.packed_r.dequantize())


def test_read_is_the_newest_token_view():
    fmt, pol = get_format("c2r4"), CachePolicy(2, 5)
    c, r = _data(1, 20, seed=7)
    layer = DualPathLayer(fmt, pol)
    _write_chunks(layer, c, r, [11, 1, 8])
    rc, rr = layer.read()
    cq = dequantize_codes(*quantize_codes(c, fmt.content), fmt.content)
    protected = [0, 1] + list(range(15, 20))
    for j in range(20):
        want = c[:, j] if j in protected else cq[:, j]
        torch.testing.assert_close(rc[:, j], want, rtol=0, atol=0)
    assert torch.equal(rr[:, 17], r[:, 17])


def test_bf16_format_is_lossless():
    layer = DualPathLayer(get_format("bf16"))
    c, r = _data(2, 9)
    _write_chunks(layer, c, r, [4, 5])
    rc, rr = layer.read()
    assert torch.equal(rc, c) and torch.equal(rr, r)


def test_memory_of_packed_store():
    fmt = get_format("c4r4")
    layer = DualPathLayer(fmt, CachePolicy(4, 8))
    c, r = _data(3, 100)
    layer.write(c, r)
    per_token = fmt.bytes_per_token(DC, DR)
    assert layer.nbytes() == 3 * 100 * per_token + 3 * (4 + 8) * (DC + DR) * 4  # fp32 buffers in this test


def test_bad_writes_raise_clear_errors():
    layer = DualPathLayer(get_format("c4r4"))
    c, r = _data(2, 4)
    with pytest.raises(ValueError, match=r"\[B, T, Dc\]"):
        layer.write(c[0], r[0])
    with pytest.raises(ValueError, match="disagree"):
        layer.write(c, r[:, :3])
    with pytest.raises(TypeError, match="share a dtype"):
        layer.write(c, r.double())
    with pytest.raises(ValueError, match="does not divide"):
        DualPathLayer(get_format("c4r4")).write(torch.randn(1, 2, 96), torch.randn(1, 2, 64))
    layer.write(c, r)
    with pytest.raises(ValueError, match="batch 2"):
        layer.write(c[:1], r[:1])
    with pytest.raises(ValueError, match="widths"):
        layer.write(torch.randn(2, 1, 256), torch.randn(2, 1, 64))
    with pytest.raises(TypeError, match="holds torch.float32"):
        layer.write(c.half(), r.half())
    with pytest.raises(ValueError, match="write the new tokens"):
        layer.attend(torch.randn(2, 1, 9, DC), torch.randn(2, 1, 9, DR), 0.1)
