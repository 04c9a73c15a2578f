"""Paged layout bytes, the torch writer (against the quant module directly) and the fused Triton writer
(bit for bit against the torch writer)."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import DEVICE, make_cache

from quantmla.kernels.paged import PagedLayout, PagedMLACache
from quantmla.quant.formats import CachePolicy, get_format
from quantmla.quant.quantize import fake_quantize

FORMATS = ["bf16", "c8r8", "c4r8", "c4r4", "c2r4"]
PAGE_BYTES = {"bf16": 73728, "c8r8": 37504, "c4r8": 21632, "c4r4": 19712, "c2r4": 11520}


@pytest.mark.parametrize("name", FORMATS)
def test_layout_bytes_deepseek_shapes(name):
    L = PagedLayout(get_format(name))
    assert L.page_bytes == PAGE_BYTES[name]
    assert L.bytes_per_token() == get_format(name).bytes_per_token(512, 64)
    assert L.rope_offset % 16 == 0 and L.meta_offset % 16 == 0 and L.page_bytes % 16 == 0


def test_layout_meta_rows_c4r4():
    L = PagedLayout(get_format("c4r4"))
    assert (L.content_scale_row, L.content_offset_row, L.rope_scale_row, L.rope_offset_row, L.meta_rows) == (
        0, 4, 8, 9, 10,
    )  # fmt: skip
    L8 = PagedLayout(get_format("c8r8"))  # symmetric: no offsets
    assert (L8.rope_scale_row, L8.meta_rows) == (4, 5)


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "c8r8", "bf16"])
def test_reference_writer_reads_back_fake_quantized(name):
    lens = [0, 1, 17, 40]
    cache, c, k = make_cache(name, lens, chunks=3)
    fmt = cache.fmt
    for b, n in enumerate(lens):
        if n == 0:
            continue
        got = cache.read_packed(b, torch.arange(n))
        want_c = fake_quantize(c[b, :n].float(), fmt.content) if fmt.content else c[b, :n].bfloat16().float()
        want_r = fake_quantize(k[b, :n].float(), fmt.rope) if fmt.rope else k[b, :n].bfloat16().float()
        torch.testing.assert_close(got, torch.cat([want_c, want_r], -1), rtol=0, atol=0)
        if fmt.is_quantized:  # sink and local ring hold BF16 copies
            s = min(n, cache.n_sink)
            assert torch.equal(cache.sink[b, :s].float(), torch.cat([c[b, :s], k[b, :s]], -1).bfloat16().float())
            for pos in range(max(0, n - cache.n_local), n):
                row = torch.cat([c[b, pos], k[b, pos]]).bfloat16()
                assert torch.equal(cache.local[b, pos % cache.n_local], row)


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "c8r8", "bf16"])
def test_read_packed_in_bf16_is_the_fp32_read_rounded_once(name):
    """``read_packed(..., dtype=bf16)`` (prefill's workspace) equals the fp32 read rounded to BF16, bit for bit; a
    BF16 path is gathered as 4-byte words (the int32 view of its region holds the same bytes as the uint8 one)."""
    lens = [0, 5, 40]
    cache, _, _ = make_cache(name, lens, chunks=2)
    for b, n in enumerate(lens):
        pos = torch.arange(n).flip(0)  # any order
        assert torch.equal(cache.read_packed(b, pos, dtype=torch.bfloat16), cache.read_packed(b, pos).bfloat16())
    for which in ("content", "rope"):
        words, raw = cache._region(which, words=True), cache._region(which)
        if words.dtype == torch.int32:
            assert torch.equal(words.contiguous().view(torch.uint8), raw.contiguous())
    if name == "bf16":
        assert cache._region("content", words=True).dtype == torch.int32


def test_reserve_out_of_pages_is_clear():
    cache = PagedMLACache("c4r4", 1, 64, kv_lora_rank=128, rope_dim=32, policy=CachePolicy(page_size=16), num_pages=2)
    with pytest.raises(RuntimeError, match="out of cache pages"):
        cache.write(torch.randn(1, 40, 128), torch.randn(1, 40, 32), impl="torch")


def test_host_lengths_advance_within_capacity_only():
    """advance_host moves the host mirror of the lengths (a replayed decode step moved the device ones) and refuses
    to leave [0, max_seq_len]; plan_longest follows the plan only while it covers every sequence."""
    cache = PagedMLACache("c4r4", 2, 64, kv_lora_rank=128, rope_dim=32, policy=CachePolicy(page_size=16), num_pages=8)
    cache.write(torch.randn(2, 10, 128), torch.randn(2, 10, 32), [10, 7], impl="torch")
    assert cache.plan_longest() == 10
    cache.advance_host(3)
    assert cache.lengths() == [13, 10] and cache.seq_lens.tolist() == [10, 7]  # the device side is the caller's
    with pytest.raises(ValueError, match="leaves \\[0, max_seq_len=64\\]"):
        cache.advance_host(52)
    with pytest.raises(ValueError, match="leaves"):
        cache.advance_host(-11)
    assert cache.lengths() == [13, 10]  # a refused move changes nothing
    assert cache.plan_lengths() == [13, 10]  # the splits are planned for the lengths themselves...
    cache.planned_length = 64
    assert cache.plan_longest() == 64
    assert cache.plan_lengths() == [64, 64]  # ...or, with a plan, for every sequence at the planned length
    cache.planned_length = 12
    with pytest.raises(ValueError, match="planned_length=12 is shorter than a sequence of 13 tokens"):
        cache.plan_lengths()


@pytest.mark.parametrize("name", FORMATS)
def test_triton_writer_bit_exact(name):
    """Prefill chunks and single decode tokens with ragged counts; pool, sink and ring equal byte for byte."""
    lens = [0, 1, 9, 37]
    kw = dict(chunks=3, seed=5)
    ref, c, k = make_cache(name, lens, writer="torch", **kw)
    tri, _, _ = make_cache(name, lens, writer="triton", **kw)
    assert torch.equal(ref.block_table, tri.block_table)
    assert torch.equal(ref.pool, tri.pool)
    assert torch.equal(ref.sink.view(torch.int16), tri.sink.view(torch.int16))
    assert torch.equal(ref.local.view(torch.int16), tri.local.view(torch.int16))
    # one more decode token per sequence
    x, y = torch.randn(4, 1, 128, device=DEVICE) * 5, torch.randn(4, 1, 32, device=DEVICE)
    x[0, 0, :] = 0.25  # constant groups (scale clamps to its floor)
    ref.write(x, y, impl="torch")
    tri.write(x, y, impl="triton")
    assert torch.equal(ref.pool, tri.pool)
    assert torch.equal(ref.local.view(torch.int16), tri.local.view(torch.int16))


def test_triton_writer_bf16_inputs_long_chunk_exact():
    """BF16 inputs; one prefill chunk longer than the local window (each ring slot must be written once)."""
    lens = [40, 3]
    ref, _, _ = make_cache("c4r4", lens, writer="torch", dtype=torch.bfloat16, seed=2)
    tri, _, _ = make_cache("c4r4", lens, writer="triton", dtype=torch.bfloat16, seed=2)
    assert torch.equal(ref.pool, tri.pool)
    assert torch.equal(ref.sink.view(torch.int16), tri.sink.view(torch.int16))
    assert torch.equal(ref.local.view(torch.int16), tri.local.view(torch.int16))


def test_triton_writer_splits_long_chunks(monkeypatch):
    """A chunk longer than one launch's token limit is written in several launches with the same bytes."""
    from quantmla.kernels import triton_writer

    monkeypatch.setattr(triton_writer, "MAX_TOKENS_PER_LAUNCH", 7)
    lens = [30, 9]
    ref, _, _ = make_cache("c2r4", lens, writer="torch", seed=4)
    tri, _, _ = make_cache("c2r4", lens, writer="triton", seed=4)
    assert torch.equal(ref.pool, tri.pool)
    assert torch.equal(ref.local.view(torch.int16), tri.local.view(torch.int16))
    assert torch.equal(ref.sink.view(torch.int16), tri.sink.view(torch.int16))


@pytest.mark.parametrize("name", ["c4r4", "c8r8", "c2r4"])
def test_triton_writer_bit_exact_on_large_values_nan_and_inf(name):
    """Issue 13 item 4: values that overflowed the fp16 scale/offset (-7e4, +-1e6, 1e7) saturate identically in
    both writers; NaN / inf stay in their own group (other groups and tokens read back as without them)."""
    policy = CachePolicy(sink=1, local=2, page_size=4)
    g = torch.Generator().manual_seed(11)
    B, T, dc, dr = 2, 7, 128, 32
    c, k = torch.randn(B, T, dc, generator=g), torch.randn(B, T, dr, generator=g)
    clean_c, clean_k = c.clone(), k.clone()
    c[0, 0, 3], c[0, 1, 10], k[0, 1, 2], c[0, 2, 64] = -7e4, 1e6, -1e6, 1e7
    c[1, 1, 5], k[1, 2, 7], c[1, 3, 100], c[1, 4, :] = float("nan"), float("inf"), float("-inf"), 3e38
    caches = {}
    for impl in ("torch", "triton"):
        cache = PagedMLACache(name, B, T, kv_lora_rank=dc, rope_dim=dr, policy=policy, device=DEVICE, fill_byte=0xFF)
        cache.write(c.to(DEVICE), k.to(DEVICE), impl=impl)
        caches[impl] = cache
    ref, tri = caches["torch"], caches["triton"]
    assert torch.equal(ref.pool, tri.pool)
    assert torch.equal(ref.sink.view(torch.int16), tri.sink.view(torch.int16))
    assert torch.equal(ref.local.view(torch.int16), tri.local.view(torch.int16))
    fmt = ref.fmt
    for b in range(B):
        got = ref.read_packed(b, torch.arange(T)).cpu()  # [T, dc + dr]
        want = torch.cat([fake_quantize(clean_c[b], fmt.content), fake_quantize(clean_k[b], fmt.rope)], -1)
        hit = torch.zeros(T, dc + dr, dtype=torch.bool)  # the groups holding an extreme value
        for t, ch in ([(0, 3), (1, 10), (1, dc + 2), (2, 64)] if b == 0 else
                      [(1, 5), (2, dc + 7), (3, 100)] + [(4, i) for i in range(dc)]):  # fmt: skip
            gs = fmt.content.group_size if ch < dc else fmt.rope.group_size
            start = ch // gs * gs if ch < dc else dc + (ch - dc) // gs * gs
            hit[t, start : start + gs] = True
        assert torch.equal(got[~hit], want[~hit]), "an extreme value leaked into another group or token"
        nan_group = hit[1] & (torch.arange(dc + dr) < dc) if b == 1 else torch.zeros(dc + dr, dtype=torch.bool)
        assert torch.isnan(got[1][nan_group]).all()
        finite = torch.ones(T, dc + dr, dtype=torch.bool)
        finite[1] = ~nan_group
        assert torch.isfinite(got[finite]).all(), "a finite (or inf) input read back as NaN/inf"


def test_row_packing_content_grouped_rope_plain_planar():
    """The layout's byte rule (kernels/layout.py), checked against the quantizer's own codes: content rows grouped
    planar (byte j of group g: channel g*G + j, and g*G + G/2 + j in the high nibble), RoPE rows plain planar
    (byte j: channel j, and j + Dr/2) -- with two groups on each path (content 256 in 128s, RoPE 128 in 64s);
    the Triton writer writes the same bytes."""
    from quantmla.quant.quantize import quantize_codes

    fmt = get_format("c4r4")
    kw = dict(dc=256, dr=128, seed=7)
    ref, c, k = make_cache(fmt, [3], writer="torch", **kw)
    tri, _, _ = make_cache(fmt, [3], writer="triton", **kw)
    assert torch.equal(ref.pool, tri.pool)
    page = ref.table.pages(0)[0]
    cc, _, _ = quantize_codes(c[0, :3].float(), ref.fmt.content)  # [3, 256]
    rc, _, _ = quantize_codes(k[0, :3].float(), ref.fmt.rope)  # [3, 128]
    cb, rb = ref._region("content")[page, :3].long(), ref._region("rope")[page, :3].long()  # [3, 128], [3, 64]
    j = torch.arange(64)
    for g in range(2):
        assert torch.equal(cb[:, 64 * g + j] & 15, cc[:, 128 * g + j].long())
        assert torch.equal(cb[:, 64 * g + j] >> 4, cc[:, 128 * g + 64 + j].long())
    assert torch.equal(rb & 15, rc[:, :64].long())
    assert torch.equal(rb >> 4, rc[:, 64:].long())


@pytest.mark.parametrize("name", ["c4r4", "c8r8", "c2r4t"])
def test_rope_rounding_writers_bit_exact_and_read_back_the_fed_codes(name):
    """With a query-aware rounding plan both writers store quantize_codes_feedback's codes (content untouched), bit
    for bit, also across a NaN / inf / saturated RoPE value; the plan is refused for a wrong width or a BF16 key."""
    from quantmla.quant.quantize import dequantize_codes
    from quantmla.quant.rounding import fit_rope_rounding, quantize_codes_feedback

    policy = CachePolicy(sink=1, local=2, page_size=4)
    g = torch.Generator().manual_seed(12)
    B, T, dc, dr = 2, 7, 128, 32
    a = torch.randn(dr, dr, generator=g)
    plan = fit_rope_rounding(a @ a.T)
    c, k = torch.randn(B, T, dc, generator=g), torch.randn(B, T, dr, generator=g) * 3
    k[0, 1, 2], k[1, 2, 7], k[1, 4, 0] = -1e6, float("inf"), float("nan")
    caches = {}
    for impl in ("torch", "triton", "rtn"):
        cache = PagedMLACache(name, B, T, kv_lora_rank=dc, rope_dim=dr, policy=policy, device=DEVICE, fill_byte=0xFF)
        if impl != "rtn":
            cache.set_rope_rounding(plan)
        cache.write(c.to(DEVICE), k.to(DEVICE), impl="torch" if impl == "rtn" else impl)
        caches[impl] = cache
    assert torch.equal(caches["torch"].pool, caches["triton"].pool)
    assert not torch.equal(caches["torch"].pool, caches["rtn"].pool)
    fmt = caches["torch"].fmt
    for b in range(B):
        got = caches["torch"].read_packed(b, torch.arange(T)).cpu()
        want_rope = dequantize_codes(*quantize_codes_feedback(k[b], fmt.rope, plan), fmt.rope)
        assert torch.equal(got[:, dc:].nan_to_num(1.5), want_rope.nan_to_num(1.5))
        assert torch.equal(got[:, :dc], caches["rtn"].read_packed(b, torch.arange(T)).cpu()[:, :dc])
    with pytest.raises(ValueError, match="has 16 channels"):
        PagedMLACache(name, 1, 8, kv_lora_rank=dc, rope_dim=16, policy=policy).set_rope_rounding(plan)
    with pytest.raises(ValueError, match="nothing to round"):
        PagedMLACache("bf16", 1, 8, kv_lora_rank=dc, rope_dim=dr, policy=policy).set_rope_rounding(plan)


@pytest.mark.parametrize("name", ["c4r4", "c2r4"])
def test_rotated_plan_writers_store_the_rotated_key_and_read_it_back(name):
    """A plan with a post-RoPE rotation U: both writers store exactly what a cache with the same plan minus U stores
    when it is fed ``k U`` (codes, scales and the BF16 sink / local copies); read back and turned with
    ``rope_key_out`` the BF16 copies are ``k`` to bf16 precision, and ``rope_query`` is ``q U``."""
    from quantmla.calibrate.query_moments import hadamard_rotation
    from quantmla.quant.rounding import RopeRounding, fit_rope_rounding

    policy = CachePolicy(sink=2, local=3, page_size=4)
    g = torch.Generator().manual_seed(21)
    B, T, dc, dr = 2, 9, 128, 32
    a = torch.randn(dr, dr, generator=g)
    plan = fit_rope_rounding(a @ a.T, rotation=hadamard_rotation(dr, seed=1))
    bare = RopeRounding(plan.order, plan.feedback)
    c, k = torch.randn(B, T, dc, generator=g), torch.randn(B, T, dr, generator=g) * 3
    k[:, :, 3] += 20.0  # an outlier channel: what the rotation spreads
    for impl in ("torch", "triton"):
        caches = []
        for p, key in ((plan, k), (bare, plan.rotate(k))):
            cache = PagedMLACache(name, B, T, kv_lora_rank=dc, rope_dim=dr, policy=policy, device=DEVICE,
                                  fill_byte=0xFF)  # fmt: skip
            cache.set_rope_rounding(p)
            cache.write(c.to(DEVICE), key.to(DEVICE), impl=impl)
            caches.append(cache)
        rot, ref = caches
        assert torch.equal(rot.pool, ref.pool), impl
        assert torch.equal(rot.sink, ref.sink) and torch.equal(rot.local, ref.local), impl
    for b in range(B):
        seen = rot.rope_key_out(rot.read_tokens(b)[:, dc:].cpu())
        for pos in (0, 1, T - 1):  # sink and local positions: BF16 copies of the rotated key
            torch.testing.assert_close(seen[pos], k[b, pos], rtol=1e-2, atol=2e-2)
    q = torch.randn(3, dr, generator=g)
    torch.testing.assert_close(rot.rope_query(q.to(DEVICE)).cpu(), q @ plan.rotation, rtol=1e-6, atol=1e-5)
