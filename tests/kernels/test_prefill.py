"""Chunked prefill over the paged cache with the per-query policy: the fp32 torch reference against an independent
float64 computation from the raw inputs, and the GPU path (BF16 workspace + fused SDPA) against the reference."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import assert_close, make_cache

from quantmla.kernels import decode_attention, prefill_attention
from quantmla.kernels.reference import decode_attention_torch
from quantmla.quant.formats import CachePolicy
from quantmla.quant.quantize import fake_quantize

SCALE = 0.125
POLICY = CachePolicy(sink=4, local=16, page_size=16)
O_TOL = dict(atol=3e-2, rtol=3e-2, min_cos=0.9995)  # BF16 workspace and queries vs the fp32 reference


def _appended(name, lens, n_new, *, T=9, dc=128, dr=32, device="cpu", seed=7, writer="torch"):
    """A hostile cache (shuffled pages, NaN in unwritten bytes) holding ``lens``, then a chunk of ``T`` rows of
    which sequence ``b`` takes the first ``n_new[b]``. Returns cache, every token's raw values [B, N + T, Dc + Dr]
    and the ``recent`` window built from the raw values (independent of the cache)."""
    cache, c, k = make_cache(name, lens, dc=dc, dr=dr, policy=POLICY, seed=seed, device=device, writer=writer)
    g = torch.Generator().manual_seed(seed + 1)
    c2, k2 = torch.randn(len(lens), T, dc, generator=g), torch.randn(len(lens), T, dr, generator=g)
    cache.write(c2.to(device), k2.to(device), n_new, impl=writer)
    raw = torch.zeros(len(lens), max(lens) + T, dc + dr)
    for b, n in enumerate(lens):
        raw[b, :n] = torch.cat([c[b, :n], k[b, :n]], -1).cpu().float()
        raw[b, n : n + n_new[b]] = torch.cat([c2[b, : n_new[b]], k2[b, : n_new[b]]], -1)
    W = POLICY.local - 1 + T
    recent = torch.zeros(len(lens), W, dc + dr, dtype=torch.bfloat16)
    for b, n in enumerate(cache.lengths()):
        for i, pos in enumerate(range(n - W, n)):
            if pos >= 0:
                recent[b, i] = raw[b, pos].bfloat16()
    return cache, raw, recent.to(device)


def _float64_policy(cache, raw, q_lat, q_pe, n_new, dc):
    """o_lat from the raw inputs: token j is BF16-rounded for the query at p when j < sink or j > p - local, else
    fake-quantized (BF16 format: always BF16); plain causal softmax; float64."""
    fmt = cache.fmt
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    for b, n in enumerate(cache.lengths()):
        x = raw[b, :n]
        bf = x.bfloat16().double()
        qz = torch.cat([fake_quantize(x[:, :dc], fmt.content) if fmt.content else x[:, :dc].bfloat16().float(),
                        fake_quantize(x[:, dc:], fmt.rope) if fmt.rope else x[:, dc:].bfloat16().float()], -1)
        for t in range(n_new[b]):
            p = n - n_new[b] + t
            full = torch.tensor([(not fmt.is_quantized) or j < POLICY.sink or j > p - POLICY.local
                                 for j in range(p + 1)])  # fmt: skip
            keys = torch.where(full[:, None], bf[: p + 1], qz[: p + 1].double())
            q = torch.cat([q_lat[b, :, t], q_pe[b, :, t]], -1).double()
            out[b, :, t] = torch.softmax(q @ keys.T * SCALE, -1) @ keys[:, :dc]
    return out


def _q(B, H, T, dc, dr, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, dc, generator=g), torch.randn(B, H, T, dr, generator=g)


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "c8r8", "c4r16", "bf16"])
def test_reference_follows_policy_ragged(name):
    """Existing lengths 40, 25, 3, 0; new rows 9, 4, 0, 7 (one more than the window, one empty, one fresh)."""
    lens, n_new = [40, 25, 3, 0], [9, 4, 0, 7]
    cache, raw, recent = _appended(name, lens, n_new)
    q_lat, q_pe = _q(4, 3, 9, 128, 32)
    got = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="torch")
    want = _float64_policy(cache, raw, q_lat, q_pe, n_new, 128)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    blocks = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="torch", chunk=2)
    torch.testing.assert_close(blocks.double(), want, rtol=1e-4, atol=1e-5)  # query blocks see only their band
    assert torch.all(got[1, :, 4:] == 0) and torch.all(got[2] == 0)  # rows past n_new are zero


def test_chunk_longer_than_window_needs_recent():
    lens, n_new = [8, 25], [30, 2]  # 30 new tokens > local 16
    cache, raw, recent = _appended("c4r4", lens, n_new, T=30)
    q_lat, q_pe = _q(2, 2, 30, 128, 32)
    with pytest.raises(ValueError, match="pass recent="):
        prefill_attention(q_lat, q_pe, cache, SCALE, n_new, impl="torch")
    got = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="torch")
    torch.testing.assert_close(got.double(), _float64_policy(cache, raw, q_lat, q_pe, n_new, 128),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def test_one_new_token_is_decode():
    """With one new token per sequence the ring holds its window: no `recent`, and the decode reference agrees."""
    cache, _, _ = _appended("c2r4", [40, 17], [1, 1], T=1)
    q_lat, q_pe = _q(2, 4, 1, 128, 32)
    got = prefill_attention(q_lat, q_pe, cache, SCALE, impl="torch")[:, :, 0]
    torch.testing.assert_close(got, decode_attention_torch(q_lat[:, :, 0], q_pe[:, :, 0], cache, SCALE),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "bf16"])
def test_sdpa_path_matches_reference(name):
    lens, n_new = [40, 25, 3], [9, 4, 1]
    cache, _, recent = _appended(name, lens, n_new)
    q_lat, q_pe = _q(3, 5, 9, 128, 32)
    ref = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="torch")
    exact = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="sdpa", dtype=torch.float32,
                              block=2)  # fmt: skip
    torch.testing.assert_close(exact, ref, rtol=1e-5, atol=1e-5)  # same math, fp32: summation order only
    fast = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="sdpa", block=4)
    assert_close(fast, ref, name=f"sdpa {name}", **O_TOL)


def test_bad_impl_is_refused():
    cache, _, recent = _appended("c4r4", [5], [2])
    with pytest.raises(ValueError, match="prefill impl"):
        prefill_attention(*_q(1, 1, 9, 128, 32), cache, SCALE, [2], recent=recent, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["c4r4", "c2r4", "c8r8", "bf16"])
def test_gpu_prefill_deepseek_shapes(name):
    """DeepSeek-V2-Lite widths, Triton writer, auto prefill (SDPA on the GPU) against the fp32 reference; and the
    decode kernel on the same cache against its reference."""
    lens, n_new = [1000, 300, 0], [16, 9, 16]
    cache, _, recent = _appended(name, lens, n_new, T=16, dc=512, dr=64, device="cuda", writer="triton")
    q_lat, q_pe = (t.cuda() for t in _q(3, 16, 16, 512, 64))
    ref = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent, impl="torch")
    fast = prefill_attention(q_lat, q_pe, cache, SCALE, n_new, recent=recent)  # auto: sdpa on CUDA
    assert_close(fast, ref, name=f"gpu prefill {name}", **O_TOL)
    out = decode_attention(q_lat[:, :, 0], q_pe[:, :, 0], cache, SCALE)
    assert_close(out, decode_attention_torch(q_lat[:, :, 0], q_pe[:, :, 0], cache, SCALE), name="decode", **O_TOL)
