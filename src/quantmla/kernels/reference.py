"""fp32 torch references for attention over a :class:`~quantmla.kernels.paged.PagedMLACache` (the oracles the
kernels match).

Absorbed MLA attention in latent space, for one layer: with ``K[j] = [c_kv[j], k_pe[j]]`` the token as
attention reads it, ``score[h, j] = softmax_scale * (q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j])``, one softmax over
all valid tokens, and ``o_lat[h] = sum_j p[h, j] c_kv[j]``. A sequence of length 0 gives ``o_lat = 0`` and
``lse = -inf``.

Which copy of token ``j`` a query at position ``p`` reads is the cache policy
(:meth:`~quantmla.quant.formats.CachePolicy.reads_full`): the BF16 copy when ``j < sink`` or ``j > p - local``,
else the packed copy. Decode (the newest token) finds its BF16 copies in the sink buffer and the local ring
(:meth:`PagedMLACache.read_tokens`). :func:`prefill_attention_torch` applies the same rule to each of ``T`` new
queries, so a prefill chunk sees exactly what token-by-token decoding would have seen; the BF16 copies of the
window positions that the chunk's own write pushed out of the ring come from ``recent``.

This module does not import :mod:`quantmla.kernels.paged` (the cache is duck-typed), so the kernels may import
it without an import circle.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from quantmla.kernels.operand_rounding import active_scheme, rounded_attention


def _check_q(q_lat: torch.Tensor, q_pe: torch.Tensor, cache, ndim: int) -> None:
    if q_lat.dim() != ndim or q_pe.dim() != ndim:
        raise ValueError(f"q_lat and q_pe must have {ndim} dims, got {list(q_lat.shape)} and {list(q_pe.shape)}")
    if q_lat.shape[0] != cache.batch or q_lat.shape[-1] != cache.kv_lora_rank:
        raise ValueError(f"q_lat must be [B={cache.batch}, H, ..., Dc={cache.kv_lora_rank}], got {list(q_lat.shape)}")
    if q_pe.shape[:-1] != q_lat.shape[:-1] or q_pe.shape[-1] != cache.rope_dim:
        raise ValueError(f"q_pe must be {list(q_lat.shape[:-1]) + [cache.rope_dim]}, got {list(q_pe.shape)}")


def decode_attention_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``q_lat [B, H, Dc]``, ``q_pe [B, H, Dr]`` -> ``o_lat [B, H, Dc]`` fp32 (and ``lse [B, H]``, natural log).

    ``q_pe`` in the coordinates the cache stores its keys in (every kernel's contract): where the cache's rounding
    plan has a post-RoPE rotation that is ``cache.rope_query(q_pe)``, which :func:`quantmla.kernels.decode_attention`
    and the prefill entry points apply; calling a kernel directly, apply it yourself."""
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
        o[b] = _attend(s, q, k, softmax_scale, None, Dc, cache)
    return (o, lse) if return_lse else o


def _attend(s, q, keys, softmax_scale: float, allowed, dc: int, cache) -> torch.Tensor:
    """``softmax(s) keys[:, :dc]`` for the scores ``s`` (scaled, masked; rows with nothing allowed give 0), or, inside
    :func:`~quantmla.kernels.operand_rounding.simulated_operand_rounding`, the same attention from ``q`` / ``keys`` /
    ``allowed`` with the scheme's rounded operands."""
    if active_scheme() != "fp32":
        c, r = cache.fmt.content, cache.fmt.rope  # the cache format's channel groups (BF16: DeepSeek's 128 / 64)
        groups = (c.group_size if c is not None else 128, r.group_size if r is not None else 64)
        return rounded_attention(q, keys, softmax_scale, allowed, dc, groups)
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ keys[:, :dc]


def full_precision_rows(cache, b: int, n: int, n_new: int, recent: torch.Tensor | None):
    """BF16 copies (as fp32) of sequence ``b``'s tokens that its last ``n_new`` queries may read in full precision.

    Returns ``full [n, Dc + Dr]`` (rows not held are 0) and ``held [n]`` bool. Sources: the sink buffer, then the
    local ring (positions ``n - n_local ..``), then ``recent[b]`` (positions ``n - W .. n - 1``, ``W =
    recent.shape[1]``), later sources overriding earlier ones; every row a query needs must be held."""
    D = cache.kv_lora_rank + cache.rope_dim
    full = torch.zeros(n, D, dtype=torch.float32, device=cache.device)
    held = torch.zeros(n, dtype=torch.bool, device=cache.device)
    sink, local = cache.bf16_positions(n)
    if len(sink):
        full[: sink.stop] = cache.sink[b, : sink.stop].float()
        held[: sink.stop] = True
    if len(local):
        pos = torch.arange(local.start, local.stop, device=cache.device)
        full[pos] = cache.local[b, pos % cache.n_local].float()
        held[pos] = True
    if recent is not None:
        w = min(recent.shape[1], n)
        if w:
            full[n - w :] = recent[b, recent.shape[1] - w :].to(cache.device).float()
            held[n - w :] = True
    lo = max(cache.n_sink, n - n_new - cache.n_local + 1)  # oldest window position a new query reads from BF16
    if cache.fmt.is_quantized and cache.n_local and lo < n and not bool(held[lo:].all()):
        raise ValueError(
            f"sequence {b}: {n_new} new queries read BF16 copies of positions {lo}..{n - 1}, but the local ring "
            f"holds only the last {cache.n_local}; pass recent= with the BF16 rows of the last "
            f"{n_new + cache.n_local - 1} positions"
        )
    return full, held


def _n_new_list(n_new, B: int, T: int) -> list[int]:
    out = [T] * B if n_new is None else [int(v) for v in (n_new.tolist() if torch.is_tensor(n_new) else n_new)]
    if len(out) != B or any(not 0 <= v <= T for v in out):
        raise ValueError(f"n_new must hold {B} counts in [0, {T}], got {out}")
    return out


def prefill_attention_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    n_new=None,
    *,
    recent: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """``q_lat [B, H, T, Dc]``, ``q_pe [B, H, T, Dr]`` for the ``T`` newest tokens -> ``o_lat [B, H, T, Dc]`` fp32.

    ``n_new[b]`` (default ``T``) is how many of the ``T`` rows are real for sequence ``b`` (its newest tokens,
    already written); rows past it are zero. Query ``t`` of sequence ``b`` sits at position ``p = n_b - n_new[b] +
    t``, sees tokens ``0 .. p`` and reads each through the policy. ``recent`` bf16 ``[B, W, Dc + Dr]``: row ``b``
    holds the BF16 copies of positions ``n_b - W .. n_b - 1`` (needed when some ``n_new[b] > 1``, see
    :func:`full_precision_rows`). ``mask``: optional bool ``[B, 1 or H, T, >= max n_b]`` over cache positions (query
    rows as in ``q_lat``), True where attention is allowed, applied on top of causality; a query with no allowed
    token gets 0. Queries are processed ``chunk`` at a time."""
    _check_q(q_lat, q_pe, cache, 4)
    B, H, T, Dc = q_lat.shape
    n_new = _n_new_list(n_new, B, T)
    o = torch.zeros(B, H, T, Dc, dtype=torch.float32, device=q_lat.device)
    quant = cache.fmt.is_quantized
    policy = replace(cache.policy, sink=cache.n_sink, local=cache.n_local)  # the buffers' sizes (capped, same reads)
    for b, n in enumerate(cache.lengths()):
        k_new = n_new[b]
        if k_new == 0:
            continue
        if k_new > n:
            raise ValueError(f"sequence {b}: {k_new} new queries but only {n} cached tokens; write the tokens first")
        dev = q_lat.device
        packed = cache.read_packed(b, torch.arange(n)).to(dev)  # [n, Dc + Dr] every token's packed copy
        kpos = torch.arange(n, device=dev)
        if quant:  # the BF16 copies the policy may read
            full, held = full_precision_rows(cache, b, n, k_new, recent)
            fpos = held.nonzero()[:, 0].to(dev)  # [F]
            full = full[held].to(dev)  # [F, Dc + Dr]
        for t0 in range(0, k_new, chunk):
            t1 = min(k_new, t0 + chunk)
            qpos = torch.arange(n - k_new + t0, n - k_new + t1, device=dev)  # [t]
            last = n - k_new + t1 - 1  # no query of this block sees past it
            q = torch.cat([q_lat[b, :, t0:t1], q_pe[b, :, t0:t1]], dim=-1).float()  # [H, t, Dc + Dr]
            keys, kp = packed[: last + 1], kpos[: last + 1]
            allowed = kp[None, :] <= qpos[:, None]  # [t, S] causal
            if mask is not None:
                allowed = allowed & mask[b, :, t0:t1, : last + 1].to(dev)  # [1 or H, t, S]
            if quant:  # each token's packed copy, plus its BF16 copy when some query here may read it: one admitted
                band = (fpos <= last) & ((fpos < policy.sink) | (fpos > qpos[0] - policy.local))
                fp = fpos[band]
                allowed = torch.cat([allowed & ~policy.reads_full(qpos, kp),
                                     allowed[..., fp] & policy.reads_full(qpos, fp)], dim=-1)  # fmt: skip
                keys = torch.cat([keys, full[band]])  # [S + F', Dc + Dr]
            s = (q @ keys.T * softmax_scale).masked_fill(~allowed, float("-inf"))  # [H, t, S + F']
            o[b, :, t0:t1] = _attend(s, q, keys, softmax_scale, allowed, Dc, cache)
    return o


def _check_up(q_nope: torch.Tensor, q_pe: torch.Tensor, cache, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
    """Shapes of the per-head prefill: ``q_nope [B, H, T, Dn]``, ``W_UK [H, Dn, Dc]``, ``W_UV [H, Dv, Dc]``."""
    H, Dc = q_nope.shape[1], cache.layout.kv_lora_rank
    if q_nope.dim() != 4 or q_pe.dim() != 4 or q_pe.shape[:3] != q_nope.shape[:3]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be [B, H, T, D] alike")
    if w_uk.dim() != 3 or tuple(w_uk.shape) != (H, q_nope.shape[-1], Dc):
        raise ValueError(f"W_UK must be [H={H}, Dn={q_nope.shape[-1]}, Dc={Dc}], got {tuple(w_uk.shape)}")
    if w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != Dc:
        raise ValueError(f"W_UV must be [H={H}, Dv, Dc={Dc}], got {tuple(w_uv.shape)}")


def prefill_attention_heads_torch(q_nope, q_pe, cache, w_uk, w_uv, softmax_scale: float, n_new=None, **kw):
    """Prefill with the per-head outputs as the result: ``q_nope [B, H, T, Dn]``, ``q_pe [B, H, T, Dr]``, ``W_UK
    [H, Dn, Dc]``, ``W_UV [H, Dv, Dc]`` -> ``o [B, H, T, Dv]`` fp32 = ``W_UV o_lat`` with ``o_lat`` from
    :func:`prefill_attention_torch` of the absorbed query ``q_nope W_UK`` (the contract of the per-head paths)."""
    _check_up(q_nope, q_pe, cache, w_uk, w_uv)
    q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope.float(), w_uk.float())
    o_lat = prefill_attention_torch(q_lat, q_pe.float(), cache, softmax_scale, n_new, **kw)
    return torch.einsum("bhtc,hvc->bhtv", o_lat, w_uv.float())
