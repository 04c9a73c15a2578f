"""The T formats (C4R4T, C2R4T: one content scale and offset per token) on the CPU: their bytes, where the codes and
the meta sit (the codes where C4R4's 128-channel packing puts them, one meta row per path and kind), the fused Triton
writer bit for bit against the torch writer and the Triton decode kernel against the fp32 reference, at DeepSeek's
latent 512 -- the width at which the scale group (512) and the packing group (128) differ -- and which CUDA kernels
take them. The CUDA kernel itself: tests/kernels/test_decode_cuda.py (GPU)."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import assert_close, make_cache

from quantmla.kernels import decode_attention
from quantmla.kernels.layout import PagedLayout
from quantmla.quant.formats import FORMATS, CachePolicy, get_format
from quantmla.quant.packing import pack
from quantmla.quant.quantize import fake_quantize, quantize_codes
from quantmla.quant.spec import QuantSpec

T_FORMATS = ["c4r4t", "c2r4t"]
POLICY = CachePolicy(sink=4, local=128, page_size=64)
KW = dict(dc=512, dr=64, policy=POLICY)


@pytest.mark.parametrize("name,per_token,page", [("c4r4t", 296, 18944), ("c2r4t", 168, 10752)])
def test_bytes_and_meta_rows(name, per_token, page):
    """By hand: codes 512 x bits / 8 + RoPE 32 bytes, then one fp16 scale and one offset per path (8 bytes)."""
    bits = int(name[1])
    fmt = get_format(name)
    assert per_token == 512 * bits // 8 + 32 + 8
    assert fmt.bytes_per_token(512, 64) == per_token
    L = PagedLayout(fmt)
    assert L.page_bytes == page == 64 * per_token
    assert (L.content_scale_row, L.content_offset_row, L.rope_scale_row, L.rope_offset_row, L.meta_rows) == (
        0, 1, 2, 3, 4,
    )  # fmt: skip
    assert L.pack_group("content") == 128 and fmt.content.group_size == 512
    assert get_format(name.upper()) is FORMATS[name]
    # on a 256-wide latent (SmolLM2-MLA, MiniCPM3) the group shrinks to the latent: still one per token
    assert fmt.adapted(256, 64).content.group_size == 256


def test_bad_token_scale_names_are_clear():
    with pytest.raises(ValueError, match="quantized content"):
        get_format("c16r4t")
    with pytest.raises(ValueError, match="trailing t"):
        get_format("c4r4x")


@pytest.mark.parametrize("name", T_FORMATS)
def test_torch_writer_packs_like_c4r4_with_one_scale_per_token(name):
    """The content bytes are the quantizer's whole-token codes packed in 128-channel groups (C4R4's rule), meta row 0
    / 1 hold the token's one scale / offset, and the read-back equals fake quantization with one group of 512."""
    cache, c, k = make_cache(name, [70], seed=3, **KW)
    bits = int(name[1])
    spec = QuantSpec(bits=bits, group_size=512)
    codes, scale, off = quantize_codes(c[0, :70].float(), spec)  # [70, 512], [70, 1]
    pages = cache.table.pages(0)
    got = torch.cat([cache._region("content")[p] for p in pages])[:70]
    assert torch.equal(got, pack(codes, bits, 128))
    assert not torch.equal(got, pack(codes, bits, None))  # the packing group is not the scale group
    meta = torch.cat([cache._meta()[p] for p in pages], dim=1)[:, :70]  # [4, 70]
    assert torch.equal(meta[0], scale[:, 0]) and torch.equal(meta[1], off[:, 0])
    want = torch.cat([fake_quantize(c[0, :70].float(), spec), fake_quantize(k[0, :70].float(), cache.fmt.rope)], -1)
    assert torch.equal(cache.read_packed(0, torch.arange(70)), want)
    per128 = fake_quantize(c[0, :70].float(), QuantSpec(bits=bits, group_size=128))
    assert not torch.equal(want[:, :512], per128)  # one scale per token, not per 128 channels


@pytest.mark.parametrize("name", T_FORMATS)
def test_triton_writer_bit_exact(name):
    """Prefill chunks with ragged counts, then one decode token each: pool, sink and ring equal byte for byte."""
    lens = [0, 1, 9, 70]
    ref, _, _ = make_cache(name, lens, writer="torch", chunks=2, seed=5, **KW)
    tri, _, _ = make_cache(name, lens, writer="triton", chunks=2, seed=5, **KW)
    assert torch.equal(ref.pool, tri.pool)
    assert torch.equal(ref.sink.view(torch.int16), tri.sink.view(torch.int16))
    assert torch.equal(ref.local.view(torch.int16), tri.local.view(torch.int16))
    x, y = torch.randn(4, 1, 512) * 5, torch.randn(4, 1, 64)
    x[0, 0, :] = 0.25  # a constant token (scale clamps to its floor)
    ref.write(x, y, impl="torch")
    tri.write(x, y, impl="triton")
    assert torch.equal(ref.pool, tri.pool)


def _triton_decode_matches_reference(cache, seed: int):
    """Three heads, two splits: the Triton decode kernel against the fp32 torch reference of the same cache (the
    tolerances of test_decode.py). Returns the kernel's (out, lse)."""
    g = torch.Generator().manual_seed(seed)
    B, name = cache.batch, cache.fmt.name
    q_lat, q_pe = torch.randn(B, 3, cache.kv_lora_rank, generator=g), torch.randn(B, 3, cache.rope_dim, generator=g)
    ref, ref_lse = decode_attention(q_lat, q_pe, cache, 0.07, impl="torch", return_lse=True)
    out, lse = decode_attention(q_lat, q_pe, cache, 0.07, impl="triton", return_lse=True, num_splits=2)
    assert_close(out, ref, atol=3e-2, rtol=3e-2, min_cos=0.9995, name=f"o_lat {name}")
    assert_close(lse, ref_lse, atol=3e-2, rtol=1e-2, min_cos=0.999, name=f"lse {name}")
    return out, lse


@pytest.mark.parametrize("name", T_FORMATS)
def test_triton_decode_against_reference(name):
    """Lengths around the sink / local edges and a page edge (133 = 4 + 1 packed token + 128), an empty sequence,
    three heads, two splits: the Triton kernel reads the 128-channel packing and the one scale row."""
    cache, _, _ = make_cache(name, [0, 133, 197, 260], seed=9, **KW)
    out, lse = _triton_decode_matches_reference(cache, seed=1)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


def test_cuda_kernels_that_take_token_scale():
    """Only the Hopper wgmma kernel is built for one content scale per token; the others say so, and auto takes
    wgmma for them at every head count (no device needed: the checks read the cache's layout)."""
    from quantmla.kernels.cuda_decode import cuda_unsupported_reason, token_scale

    cache, _, _ = make_cache("c4r4t", [5], **KW)
    assert token_scale(cache.fmt) and not token_scale(get_format("c4r4"))
    assert cuda_unsupported_reason(cache, "wgmma") == ""
    for kernel in ("mma", "ws"):
        assert "per token" in cuda_unsupported_reason(cache, kernel)
    sym = get_format("c4r4t")
    sym = type(sym)("c4r4t-sym", QuantSpec(4, 512, symmetric=True), sym.rope)
    cache_sym, _, _ = make_cache(sym, [5], **KW)
    assert "asymmetric" in cuda_unsupported_reason(cache_sym, "wgmma")


@pytest.mark.parametrize("name", T_FORMATS)
def test_smollm2_latent_256_writer_and_decode(name):
    """SmolLM2-MLA's widths (latent 256, RoPE 128): the group shrinks to the latent (256), the codes stay in groups of
    128 -- two of the Triton kernel's 64-channel sub-tiles per packing group (4 bit: the two planes of a byte; 2 bit:
    two planes each), all four scaled by meta row 0. Writer bit for bit, decode against the reference."""
    kw = dict(dc=256, dr=128, policy=CachePolicy(sink=4, local=16, page_size=64), seed=6)
    lens = [100, 0, 70, 21]
    tri, _, _ = make_cache(name, lens, writer="triton", **kw)
    ref_cache, _, _ = make_cache(name, lens, writer="torch", **kw)
    assert tri.fmt.content.group_size == 256 and tri.layout.pack_group("content") == 128
    assert torch.equal(tri.pool, ref_cache.pool)
    _triton_decode_matches_reference(tri, seed=0)
