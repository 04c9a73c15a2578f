"""The torch decode reference and what it reads, against independent constructions from the raw inputs, at every
length around the sink and the local window (where a token read from the wrong copy is one of a few, so visible).

What decode attention must read for a sequence of length ``n`` (the policy for the newest query): token ``j`` from
its BF16 copy when ``j < sink`` or ``j >= n - local``, else its packed copy (``fake_quantize`` of the raw value,
the quantizer being tested on its own); the BF16 format reads BF16 everywhere. Built here by hand, token by token.
"""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import make_cache

from quantmla.kernels.reference import decode_attention_torch
from quantmla.quant.formats import CachePolicy
from quantmla.quant.quantize import fake_quantize

POLICY = CachePolicy(sink=4, local=16, page_size=16)
DC, DR, SCALE = 128, 32, 0.125
EDGES = [1, 2, 3, 4, 5, 6, 15, 16, 17, 19, 20, 21, 22, 23, 37, 40]  # around sink (4), local (16), sink + local (20)


def _seen_by_hand(fmt, c, k, n):
    """[n, DC + DR] fp32: what the newest query of a length-n sequence reads, from the raw c [>= n, DC], k."""
    rows = []
    for j in range(n):
        raw = torch.cat([c[j], k[j]]).float()
        full = (not fmt.is_quantized) or j < POLICY.sink or j >= n - POLICY.local
        if full:
            rows.append(raw.bfloat16().float())
        else:
            cq = fake_quantize(c[j : j + 1].float(), fmt.content)[0] if fmt.content else c[j].bfloat16().float()
            kq = fake_quantize(k[j : j + 1].float(), fmt.rope)[0] if fmt.rope else k[j].bfloat16().float()
            rows.append(torch.cat([cq, kq]))
    return torch.stack(rows) if rows else torch.zeros(0, DC + DR)


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "c8r8", "c4r16", "c16r4", "bf16"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_read_tokens_is_the_policy_at_every_length(name, chunks):
    lens = list(range(0, 42))
    cache, c, k = make_cache(name, lens, dc=DC, dr=DR, policy=POLICY, chunks=chunks, seed=9, device="cpu")
    for b, n in enumerate(lens):
        got = cache.read_tokens(b)
        want = _seen_by_hand(cache.fmt, c[b].cpu(), k[b].cpu(), n)
        bad = torch.nonzero((got.cpu() != want).any(-1)).flatten().tolist()
        assert not bad, f"length {n}: tokens {bad} not read as the policy says"


def _dense_float64(fmt, c, k, lens, q_lat, q_pe):
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        x = _seen_by_hand(fmt, c[b], k[b], n).double()  # [n, DC + DR]
        q = torch.cat([q_lat[b], q_pe[b]], -1).double()  # [H, DC + DR]
        out[b] = torch.softmax(q @ x.T * SCALE, -1) @ x[:, :DC]
    return out


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "c8r8", "c4r16", "bf16"])
def test_decode_reference_matches_float64_at_the_window_edges(name):
    """Short sequences around the edges: one token read from the wrong copy moves the output by ~1e-2, far above
    the fp32 tolerance used here."""
    lens = [0, *EDGES]
    cache, c, k = make_cache(name, lens, dc=DC, dr=DR, policy=POLICY, chunks=2, seed=10, device="cpu")
    g = torch.Generator().manual_seed(2)
    q_lat, q_pe = torch.randn(len(lens), 3, DC, generator=g), torch.randn(len(lens), 3, DR, generator=g)
    got, lse = decode_attention_torch(q_lat, q_pe, cache, SCALE, return_lse=True)
    want = _dense_float64(cache.fmt, c.cpu(), k.cpu(), lens, q_lat, q_pe)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.all(got[0] == 0) and torch.all(torch.isneginf(lse[0]))


@pytest.mark.parametrize("name", ["c4r4", "c2r4", "bf16"])
def test_decode_reference_matches_float64_long(name):
    """4097 tokens (several pages, default policy) beside short ones."""
    policy = CachePolicy()
    lens = [4097, 1, 133]
    cache, c, k = make_cache(name, lens, dc=DC, dr=DR, policy=policy, chunks=2, seed=6, device="cpu")
    if cache.fmt.is_quantized:
        assert cache.n_sink == policy.sink and cache.n_local == policy.local
    g = torch.Generator().manual_seed(3)
    q_lat, q_pe = torch.randn(3, 2, DC, generator=g), torch.randn(3, 2, DR, generator=g)
    got = decode_attention_torch(q_lat, q_pe, cache, SCALE)
    want = torch.zeros(got.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        x = torch.cat([c[b, :n], k[b, :n]], -1).cpu().float()
        full = torch.zeros(n, dtype=torch.bool)
        if cache.fmt.is_quantized:
            full[: policy.sink] = True
            full[max(0, n - policy.local) :] = True
        else:
            full[:] = True
        qz = torch.cat([fake_quantize(x[:, :DC], cache.fmt.content) if cache.fmt.content else x[:, :DC],
                        fake_quantize(x[:, DC:], cache.fmt.rope) if cache.fmt.rope else x[:, DC:]], -1)  # fmt: skip
        keys = torch.where(full[:, None], x.bfloat16().double(), qz.double())
        q = torch.cat([q_lat[b], q_pe[b]], -1).double()
        want[b] = torch.softmax(q @ keys.T * SCALE, -1) @ keys[:, :DC]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
