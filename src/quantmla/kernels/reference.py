"""fp32 torch references for attention over a :class:`PagedMLACache` (the oracles the kernels match).

Absorbed MLA attention in latent space, for one layer: with ``K[j] = [c_kv[j], k_pe[j]]`` the token as
attention reads it (BF16 for sink/local positions, dequantized packed copy otherwise, see
:meth:`PagedMLACache.read_tokens`), ``score[h, j] = softmax_scale * (q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j])``,
one softmax over all valid tokens, and ``o_lat[h] = sum_j p[h, j] c_kv[j]``. A sequence of length 0 gives
``o_lat = 0`` and ``lse = -inf``.

:func:`prefill_attention_torch` is the chunked prefill over the quantized cache: it is plain torch
(correct, not fast). After ``T`` new tokens were appended, query ``t`` of sequence ``b`` sees positions
``0 .. n_b - n_new[b] + t``, each read as decode would read it at the cache's *current* length (so the
last ``local`` positions come from BF16, older ones from their packed copy).
"""

from __future__ import annotations

import torch

from quantmla.kernels.paged import PagedMLACache


def _check_q(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: PagedMLACache, ndim: int) -> None:
    if q_lat.dim() != ndim or q_pe.dim() != ndim:
        raise ValueError(f"q_lat and q_pe must have {ndim} dims, got {list(q_lat.shape)} and {list(q_pe.shape)}")
    if q_lat.shape[0] != cache.batch or q_lat.shape[-1] != cache.kv_lora_rank:
        raise ValueError(f"q_lat must be [B={cache.batch}, H, ..., Dc={cache.kv_lora_rank}], got {list(q_lat.shape)}")
    if q_pe.shape[:-1] != q_lat.shape[:-1] or q_pe.shape[-1] != cache.rope_dim:
        raise ValueError(f"q_pe must be {list(q_lat.shape[:-1]) + [cache.rope_dim]}, got {list(q_pe.shape)}")


def decode_attention_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedMLACache,
    softmax_scale: float,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``q_lat [B, H, Dc]``, ``q_pe [B, H, Dr]`` -> ``o_lat [B, H, Dc]`` fp32 (and ``lse [B, H]``, natural log)."""
    _check_q(q_lat, q_pe, cache, 3)
    B, H, Dc = q_lat.shape
    o = torch.zeros(B, H, Dc, dtype=torch.float32, device=q_lat.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    for b, n in enumerate(cache.lengths()):
        if n == 0:
            continue
        k = cache.read_tokens(b, n).to(q_lat.device)  # [n, Dc + Dr]
        q = torch.cat([q_lat[b], q_pe[b]], dim=-1).float()  # [H, Dc + Dr]
        s = (q @ k.T) * softmax_scale  # [H, n]
        lse[b] = torch.logsumexp(s, dim=-1)
        o[b] = torch.softmax(s, dim=-1) @ k[:, :Dc]
    return (o, lse) if return_lse else o


def prefill_attention_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedMLACache,
    softmax_scale: float,
    n_new=None,
    *,
    chunk: int = 1024,
) -> torch.Tensor:
    """``q_lat [B, H, T, Dc]``, ``q_pe [B, H, T, Dr]`` for the ``T`` newest tokens -> ``o_lat [B, H, T, Dc]`` fp32.

    ``n_new[b]`` (default ``T``) is how many of the ``T`` rows are real for sequence ``b``; rows past it are
    zero. Queries are processed ``chunk`` at a time (memory ``O(chunk * n)`` per sequence)."""
    _check_q(q_lat, q_pe, cache, 4)
    B, H, T, Dc = q_lat.shape
    lens = cache.lengths()
    n_new = [T] * B if n_new is None else [int(v) for v in (n_new.tolist() if torch.is_tensor(n_new) else n_new)]
    o = torch.zeros(B, H, T, Dc, dtype=torch.float32, device=q_lat.device)
    for b, n in enumerate(lens):
        k_new = n_new[b]
        if k_new == 0:
            continue
        if k_new > n:
            raise ValueError(f"sequence {b}: {k_new} new queries but only {n} cached tokens; write the tokens first")
        k = cache.read_tokens(b, n).to(q_lat.device)  # [n, Dc + Dr]
        first = n - k_new  # position of query 0
        for t0 in range(0, k_new, chunk):
            t1 = min(k_new, t0 + chunk)
            q = torch.cat([q_lat[b, :, t0:t1], q_pe[b, :, t0:t1]], dim=-1).float()  # [H, t, Dc + Dr]
            last = first + t1 - 1  # no query of this chunk sees past it
            s = (q @ k[: last + 1].T) * softmax_scale  # [H, t, S]
            qpos = torch.arange(first + t0, first + t1, device=q.device)  # [t]
            kpos = torch.arange(last + 1, device=q.device)  # [S]
            s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
            o[b, :, t0:t1] = torch.softmax(s, dim=-1) @ k[: last + 1, :Dc]
    return o
