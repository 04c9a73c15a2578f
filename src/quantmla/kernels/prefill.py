"""Chunked prefill attention over the paged cache on a GPU: the per-query policy through torch's fused attention.

Same contract as :func:`quantmla.kernels.reference.prefill_attention_torch` (the fp32 oracle). Per sequence the
packed copies of its ``n`` tokens are dequantized once into a transient BF16 workspace ``[n, Dc + Dr]`` (through
:meth:`PagedMLACache.read_packed`, never by decoding page bytes here), the BF16 copies the policy may read (sink
buffer, local ring, ``recent``) are appended as ``F`` more keys, and every block of queries runs one
``torch.nn.functional.scaled_dot_product_attention`` over the ``n + F`` keys with a boolean mask that admits, for
the query at position ``p``, the packed copy of token ``j`` when ``j <= p`` and the policy reads it packed, and
the BF16 copy when ``j <= p`` and the policy reads it in full precision: one softmax, exactly the policy. The
attention kernel itself (chosen by torch: memory-efficient where it takes the shapes, else math) runs in BF16 with
fp32 accumulation, so this path agrees with the oracle to BF16 rounding. Every query block reads only the keys it
may see (the causal prefix and the BF16 copies in its window band). Memory: the workspace plus a ``[H x block, n +
F]`` mask (kept near 64 MB).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from quantmla.kernels.reference import _check_q, _n_new_list, full_precision_rows


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, t, D], k [N, D], v [N, Dv], mask bool [t, N] -> [H, t, Dv]. Every query head reads the same keys (one
    latent KV head), so the ``H x t`` queries go in as the queries of one head: no key copies, and any backend
    that takes a mask (memory-efficient, math) can run it."""
    H, t, D = q.shape
    m = mask[None].expand(H, t, mask.shape[1]).reshape(1, 1, H * t, mask.shape[1])
    o = F.scaled_dot_product_attention(q.reshape(1, 1, H * t, D), k[None, None], v[None, None], attn_mask=m,
                                       scale=scale)  # fmt: skip
    return o.reshape(H, t, v.shape[-1])


def prefill_attention_sdpa(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    n_new=None,
    *,
    recent: torch.Tensor | None = None,
    block: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``q_lat [B, H, T, Dc]``, ``q_pe [B, H, T, Dr]`` -> ``o_lat [B, H, T, Dc]`` fp32 (rows past ``n_new[b]`` are 0).

    ``block``: queries per attention call (default: keeps the mask near 64 MB); ``dtype``: of the workspace and
    the queries (BF16; fp32 gives the oracle's numbers up to summation order)."""
    _check_q(q_lat, q_pe, cache, 4)
    B, H, T, Dc = q_lat.shape
    n_new = _n_new_list(n_new, B, T)
    dev = q_lat.device
    o = torch.zeros(B, H, T, Dc, dtype=torch.float32, device=dev)
    quant = cache.fmt.is_quantized
    policy = replace(cache.policy, sink=cache.n_sink, local=cache.n_local)
    for b, n in enumerate(cache.lengths()):
        k_new = n_new[b]
        if k_new == 0:
            continue
        if k_new > n:
            raise ValueError(f"sequence {b}: {k_new} new queries but only {n} cached tokens; write the tokens first")
        packed = cache.read_packed(b, torch.arange(n)).to(device=dev, dtype=dtype)  # [n, Dc + Dr] workspace
        kpos = torch.arange(n, device=dev)
        if quant:
            full, held = full_precision_rows(cache, b, n, k_new, recent)
            fpos = held.nonzero()[:, 0].to(dev)  # [F] positions with a BF16 copy
            full = full[held].to(device=dev, dtype=dtype)  # [F, Dc + Dr]
        step = block or max(1, min(k_new, (64 << 20) // max(1, 2 * n * H)))  # mask [H * step, <= 2n] <= 64 MB
        for t0 in range(0, k_new, step):
            t1 = min(k_new, t0 + step)
            qpos = torch.arange(n - k_new + t0, n - k_new + t1, device=dev)  # [t]
            last = n - k_new + t1 - 1  # no query of this block sees past it
            keys, kp = packed[: last + 1], kpos[: last + 1]
            mask = kp[None, :] <= qpos[:, None]  # [t, S] causal, packed copies
            if quant:  # BF16 copies some query of this block may read (sink, window band)
                band = (fpos <= last) & ((fpos < policy.sink) | (fpos > qpos[0] - policy.local))
                fp = fpos[band]
                mask_f = (fp[None, :] <= qpos[:, None]) & policy.reads_full(qpos, fp)  # [t, F']
                mask = torch.cat([mask & ~policy.reads_full(qpos, kp), mask_f], dim=1)
                keys = torch.cat([keys, full[band]])  # [S + F', Dc + Dr]
            q = torch.cat([q_lat[b, :, t0:t1], q_pe[b, :, t0:t1]], dim=-1).to(dtype)  # [H, t, Dc + Dr]
            o[b, :, t0:t1] = _attend(q, keys, keys[:, :Dc], mask, softmax_scale).float()
    return o
