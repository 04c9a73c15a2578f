"""Shared helpers for the kernel tests: cache builders, the per-output comparison, and an mbarrier model for the
pipeline-protocol tests."""

from __future__ import annotations

import torch

from quantmla.kernels.paged import PagedMLACache
from quantmla.quant.formats import CachePolicy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_cache(fmt, lens, *, dc=128, dr=32, policy=None, seed=0, dtype=torch.float32, device=DEVICE, chunks=1,
               writer="torch", value_scale=1.0):  # fmt: skip
    """A hostile cache: shuffled pages, NaN in every unwritten byte (0xFF), unused block-table entries pointing
    at a NaN page; tokens written in ``chunks`` appends. Returns (cache, c_kv [B, N, dc], k_pe [B, N, dr])."""
    policy = policy or CachePolicy(sink=4, local=16, page_size=16)
    g = torch.Generator().manual_seed(seed)
    B, N = len(lens), max(max(lens), 1)
    c = torch.randn(B, N, dc, generator=g) * torch.linspace(0.1, 2.0, dc)  # uneven channel ranges
    k = torch.randn(B, N, dr, generator=g) * 1.5
    c[:, ::7, :16] += 2.0  # shifted channels (asymmetric group ranges)
    c = c * value_scale  # small values -> small quantization scales (fp16 range of the kernels' products)
    pages = sum(-(-(n + 16) // policy.page_size) for n in lens) + 3  # room to append 16 more per sequence
    cache = PagedMLACache(
        fmt, B, N + 16, kv_lora_rank=dc, rope_dim=dr, policy=policy, num_pages=pages, device=device, shuffle=True,
        seed=seed, fill_byte=0xFF, pad_page=pages - 1,
    )  # fmt: skip
    c, k = c.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)
    bounds = [round(i * N / chunks) for i in range(chunks + 1)]
    for t0, t1 in zip(bounds[:-1], bounds[1:]):
        n_new = [max(0, min(n, t1) - t0) for n in lens]
        cache.write(c[:, t0:t1], k[:, t0:t1], n_new, impl=writer)
    return cache, c, k


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float, min_cos: float, name: str):
    """NaN/inf in the same places, then |out - ref| <= atol + rtol |ref| elementwise, then cosine >= min_cos."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{name}: NaN in different places"
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), f"{name}: inf in different places"
    fin = torch.isfinite(ref)
    o, r = out[fin], ref[fin]
    if r.numel() == 0:
        return
    bad = (o - r).abs() > atol + rtol * r.abs()
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, max abs err {(o - r).abs().max().item():.3g}"
    if r.norm() > 0:
        cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()
        assert cos >= min_cos, f"{name}: cosine {cos:.6f} < {min_cos}"


class Mbarrier:
    """An mbarrier as the pipeline-protocol tests model it: `count` arrivals complete a phase; try_wait.parity(P)
    passes while the current phase's parity is not P (so a wrong parity passes early, as on the GPU)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passes(self, parity):
        return (self.phase & 1) != parity
