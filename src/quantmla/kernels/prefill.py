"""Chunked prefill attention over the paged cache on a GPU: the per-query policy in BF16 with fp32 statistics.

Same contract as :func:`quantmla.kernels.reference.prefill_attention_torch` (the fp32 oracle). Per sequence the
packed copies of its ``n`` tokens are dequantized once into a transient BF16 workspace ``[n, Dc + Dr]`` (through
:meth:`PagedMLACache.read_packed`, never by decoding page bytes here); the BF16 copies the policy may read (sink
buffer, local ring, ``recent``) come from :func:`full_precision_rows`. Every query head reads the same keys (one
latent KV head), so the ``H x t`` queries of a block of ``t`` positions run as ``H * t`` rows of one attention.

:func:`prefill_attention_split` (``impl="split"``, the GPU default) splits the keys of a query block ``[q0, q1)``:

* **far**: :meth:`CachePolicy.packed_for_all` ``(q0)`` -- positions ``sink <= j <= q0 - local`` that every query of
  the block sees and reads packed: attention with no mask, over key tiles of a bounded size;
* **near**: the packed copies of ``q0 - local < j < q1`` and the BF16 copies of the sink and of that band, with the
  policy's mask (a copy is admitted when the key is causal and :meth:`CachePolicy.reads_full` picks that copy):
  ``local + t`` keys of each kind, whatever the context.

Per head on CUDA (:func:`prefill_attention_heads`) every part runs in a fused attention kernel that returns the
log-sum-exp (:mod:`quantmla.kernels.fused_prefill`), in query blocks of :data:`FUSED_BLOCK` positions: from position
``sink + local`` on a block splits into the far keys (unmasked), a causal triangle of packed copies and the BF16
band (one batched masked call), ~3.5x less near-band work than one masked call over ``2 (local + t)`` keys; a
prompt's first ``sink + local`` positions run the near band with the policy's mask as a finite additive bias
(``fused_prefill.near_bias``). Score tiles were the cost before (launches: 8.9-14.4 ms per layer for a 4K prompt
against 0.25 ms for torch's own attention, ``benchmarks/results/prefill_h200_heads_fused.md``); one masked near
call per block gave 3.2 / 5.5 ms (BF16 / C4R4, ``prefill_h200_heads_near.md``).

A BF16 cache has one copy per token: its policy is taken as ``sink = local = 0`` (far: ``j <= q0``; near: the
causal triangle of the block).

Each tile is two matrix products (BF16 in, fp32 out: ``torch.mm(..., out_dtype=torch.float32)`` on CUDA) and
fp32 softmax statistics (row max, sum of the BF16-rounded probabilities); tiles merge exactly by their
log-sum-exps (online softmax in fp32). Where ``torch.mm`` has no ``out_dtype`` (torch < 2.8, the CPU) the products
take fp32 copies of the BF16 operands: the same numbers, slower. No ``[H t, n]`` mask and no copy of the far keys
is made (the near band's ``2 (local + t)`` keys are gathered); the scores of one
tile (``[H t, key tile]`` fp32 + BF16) are kept near 384 MB. ``dtype=torch.float32`` gives the oracle's numbers
up to summation order.

:func:`prefill_attention_sdpa` (``impl="sdpa"``, the previous GPU path, kept for comparison) runs torch's fused
attention over all ``n`` packed copies plus the BF16 copies with one boolean mask ``[H x block, n + F]`` (kept near
64 MB): at 32K keys that is blocks of 64 queries (the H200 measured it 20-30x slower than transformers' own
attention on a 32K prompt, benchmarks/results/generate_h200_v2lite_32k.md).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace

import torch
import torch.nn.functional as F

import quantmla.kernels.fused_prefill as fused_prefill
from quantmla.kernels.reference import _check_q, _check_up, _n_new_list, full_precision_rows


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, t, D], k [N, D], v [N, Dv], mask bool [t, N] -> [H, t, Dv]. Every query head reads the same keys (one
    latent KV head), so the ``H x t`` queries go in as the queries of one head: no key copies, and any backend
    that takes a mask (memory-efficient, math) can run it."""
    H, t, D = q.shape
    m = mask[None].expand(H, t, mask.shape[1]).reshape(1, 1, H * t, mask.shape[1])
    o = F.scaled_dot_product_attention(q.reshape(1, 1, H * t, D), k[None, None], v[None, None], attn_mask=m,
                                       scale=scale)  # fmt: skip
    return o.reshape(H, t, v.shape[-1])


def _sequence_copies(cache, b: int, n: int, k_new: int, recent, dev, dtype):
    """The copies prefill reads for sequence ``b`` (``n`` cached tokens, the ``k_new`` newest being queried): the
    packed copies of all ``n`` tokens dequantized into a transient workspace ``[n, D]``, the sorted positions ``[F]``
    that also have a BF16 copy (sink, local ring, ``recent``) and those copies ``[F, D]`` (none for a BF16 cache)."""
    if k_new > n:
        raise ValueError(f"sequence {b}: {k_new} new queries but only {n} cached tokens; write the tokens first")
    packed = cache.read_packed(b, torch.arange(n), dtype=dtype).to(dev)
    if not cache.fmt.is_quantized:
        return packed, torch.zeros(0, dtype=torch.long, device=dev), packed[:0]
    full, held = full_precision_rows(cache, b, n, k_new, recent)
    return packed, held.nonzero()[:, 0].to(dev), full[held].to(device=dev, dtype=dtype)


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
        packed, fpos, full = _sequence_copies(cache, b, n, k_new, recent, dev, dtype)  # [n, D], [F], [F, D]
        kpos = torch.arange(n, device=dev)
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


ROWS = 8192  # query rows (heads x positions) per block of the split path
PER_HEAD_KEYS = 1 << 30  # bytes: a sequence's up-projected keys and values are made once when they fit, else per tile
SCORES = 1 << 26  # scores per tile: [rows, keys] fp32 + BF16 = 384 MB
FUSED_BLOCK = 8192  # query positions per block where a fused kernel runs both parts (per head on CUDA): the near
# band's additive mask is [block, sink + local + block] (136 MB in BF16 at DeepSeek's policy), no score is stored
_MM_OUT_DTYPE: dict[str, bool] = {}  # per device: whether torch.mm takes out_dtype there (torch >= 2.8 on CUDA)


def _mm_out_dtype(device: torch.device) -> bool:
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        x = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
        try:
            _MM_OUT_DTYPE[key] = torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N]`` -> fp32 ``[G, M, N]``: exact products, fp32 sums, no rounding of the result to
    ``a``'s dtype (cuBLAS with an fp32 output where torch offers it; the same numbers from fp32 inputs elsewhere)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _mm_out_dtype(a.device):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _finite(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(m), m, 0.0)


class _Softmax:
    """Online softmax of ``G x M`` query rows over key tiles: running max ``m [G, M, 1]`` (scaled logits), sum ``l
    [G, M, 1]`` and unnormalized output ``acc [G, M, Dv]``, all fp32. ``G = 1, M = H t`` in latent space (every
    head reads the same keys), ``G = H, M = t`` per head."""

    def __init__(self, scale: float, heads: int) -> None:
        self.scale, self.heads = scale, heads
        self.m = self.l = self.acc = None

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        """``q [G, M, D]``, ``k [G, S, D]``, ``v [G, S, Dv]``; ``allowed`` bool ``[t, S]`` (the same for every
        head)."""
        s = _mm32(q, k.transpose(1, 2))  # [G, M, S] raw logits
        if allowed is not None:
            s.view(self.heads, -1, s.shape[-1]).masked_fill_(~allowed, float("-inf"))
        m = s.amax(dim=-1, keepdim=True) * self.scale  # [G, M, 1]; -inf where a row admits nothing here
        torch.add(-_finite(m), s, alpha=self.scale, out=s)  # scale * s - m, in place (that row: p = 0, l = 0)
        p = s.exp_() if q.dtype == torch.float32 else torch.exp(s, out=torch.empty_like(s, dtype=q.dtype))
        l = p.sum(dim=-1, keepdim=True, dtype=torch.float32)  # [G, M, 1] of the probabilities the product uses
        self._merge(m, l, _mm32(p, v))  # [G, M, Dv]

    def add_normalized(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        """A part attended elsewhere: its normalized output ``o [G, M, Dv]`` and log-sum-exp ``lse [G, M, 1]`` (of
        the scaled logits) are the state ``m = lse, l = 1, acc = o``."""
        self._merge(lse, torch.ones_like(lse), o)

    def _merge(self, m: torch.Tensor, l: torch.Tensor, o: torch.Tensor) -> None:
        if self.m is None:
            self.m, self.l, self.acc = m, l, o
            return
        new = torch.maximum(self.m, m)
        a, c = torch.exp(self.m - _finite(new)), torch.exp(m - _finite(new))  # exp(-inf) = 0 for empty parts
        self.m, self.l = new, self.l * a + l * c
        self.acc = self.acc.mul_(a).add_(o * c)

    def result(self) -> torch.Tensor:
        return self.acc / self.l  # [G, M, Dv]


class _Latent:
    """Operands of the split path in latent space: one KV head (the workspace rows), ``H t`` query rows."""

    fused_keys = 0  # 576 / 512 wide: the score tiles, never a fused kernel
    per_head = False

    def __init__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, dtype: torch.dtype) -> None:
        self.q_lat, self.q_pe, self.dtype, self.dv = q_lat, q_pe, dtype, q_lat.shape[-1]

    def query(self, b: int, t0: int, t1: int) -> torch.Tensor:  # [1, H t, Dc + Dr]
        return torch.cat([self.q_lat[b, :, t0:t1], self.q_pe[b, :, t0:t1]], dim=-1).to(self.dtype).flatten(0, 1)[None]

    def sequence(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def far(self, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(self.packed[k0:k1])

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [S, Dc + Dr] -> keys, values
        return x[None], x[None, :, : self.dv]


def _split(ops, cache, softmax_scale: float, n_new, recent, B: int, H: int, T: int, dev, *, block, key_block,
           dtype) -> torch.Tensor:  # fmt: skip
    """The split path's loop over sequences, query blocks and key tiles with the operands of ``ops`` (:class:`_Latent`
    or :class:`_PerHead`) -> ``[B, H, T, ops.dv]`` fp32 (rows past ``n_new[b]`` are 0)."""
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    o = torch.zeros(B, H, T, ops.dv, dtype=torch.float32, device=dev)
    quant = cache.fmt.is_quantized
    # a BF16 cache has one copy of each token: the policy with no sink and no window reads it everywhere
    policy = replace(cache.policy, sink=cache.n_sink, local=cache.n_local) if quant else replace(
        cache.policy, sink=0, local=0)  # fmt: skip
    step = block or (FUSED_BLOCK if ops.per_head else max(1, ROWS // H))
    for b, n in enumerate(cache.lengths()):
        k_new = n_new[b]
        if k_new == 0:
            continue
        packed, fpos_t, full = _sequence_copies(cache, b, n, k_new, recent, dev, dtype)  # [n, D], [F], [F, D]
        ops.sequence(packed)
        fpos = fpos_t.tolist()
        n_sink = bisect_left(fpos, policy.sink)  # the first n_sink BF16 copies are the sink's
        edge = policy.sink + policy.local - (n - k_new)  # blocks from here on split cheaply (fused_prefill)
        starts = sorted(set(range(0, k_new, step)) | ({edge} if ops.per_head and 0 < edge < k_new else set()))
        for t0, t1 in zip(starts, starts[1:] + [k_new]):
            q0, q1 = n - k_new + t0, n - k_new + t1  # absolute positions of the block
            q = ops.query(b, t0, t1)  # [G, M, D]
            sm = _Softmax(softmax_scale, H)
            parts = None  # on CUDA per head: far, causal triangle and BF16 band, each in one fused call
            if ops.per_head:
                parts = fused_prefill.block_parts(ops, q, full, fpos, policy.sink, policy.local, q0, q1,
                                                  softmax_scale)  # fmt: skip
            if parts is not None:
                for part in parts:
                    sm.add_normalized(*part)
                o[b, :, t0:t1] = sm.result().view(H, t1 - t0, ops.dv)
                continue
            kb = key_block or max(1, SCORES // (q.shape[0] * q.shape[1]))
            far = policy.packed_for_all(q0)
            k_tiles = far.start  # far: packed, seen by every query of the block
            for k0 in range(far.start, far.stop, ops.fused_keys) if ops.fused_keys else ():
                fused = fused_prefill.attention(q, *ops.far(k0, min(far.stop, k0 + ops.fused_keys)), softmax_scale)
                if fused is None:  # no fused kernel here (the CPU): score tiles from k0 on
                    break
                sm.add_normalized(*fused)  # per head on CUDA: a fused kernel per chunk of far keys
                k_tiles = min(far.stop, k0 + ops.fused_keys)
            for k0 in range(k_tiles, far.stop, kb):
                sm.add(q, *ops.far(k0, min(far.stop, k0 + kb)))
            f0, f1 = bisect_left(fpos, far.stop), bisect_left(fpos, q1)  # BF16 copies in [far.stop, q1)
            near = range(far.stop, max(far.stop, q1))  # packed copies the policy may read for some query here
            kpos = torch.cat([torch.arange(near.start, near.stop, device=dev), fpos_t[:n_sink], fpos_t[f0:f1]])  # [S]
            is_full = torch.arange(len(kpos), device=dev) >= len(near)  # [S] which copies are BF16
            k, v = ops.rows(torch.cat([packed[near.start : near.stop], full[:n_sink], full[f0:f1]]))  # [G, S, .]
            qpos = torch.arange(q0, q1, device=dev)  # [t]
            allowed = (kpos[None, :] <= qpos[:, None]) & (policy.reads_full(qpos, kpos) == is_full[None, :])
            fused = fused_prefill.attention(q, k, v, softmax_scale, allowed) if ops.per_head else None
            if fused is not None:  # per head on CUDA: the near band in one masked fused call
                sm.add_normalized(*fused)
            for k0 in range(0, len(kpos), kb) if fused is None else ():  # near: the band where the copy read
                sl = slice(k0, k0 + kb)  # depends on the query, in score tiles
                sm.add(q, k[:, sl], v[:, sl], allowed[:, sl])
            o[b, :, t0:t1] = sm.result().view(H, t1 - t0, ops.dv)
    return o


def prefill_attention_split(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    n_new=None,
    *,
    recent: torch.Tensor | None = None,
    block: int | None = None,
    key_block: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``q_lat [B, H, T, Dc]``, ``q_pe [B, H, T, Dr]`` -> ``o_lat [B, H, T, Dc]`` fp32 (rows past ``n_new[b]`` are 0).

    ``block``: query positions per block (default ``ROWS // H``); ``key_block``: keys per tile (default ``SCORES //
    (H * block)``); ``dtype``: of the workspace, the queries and the probabilities (BF16; fp32 gives the oracle's
    numbers up to summation order)."""
    _check_q(q_lat, q_pe, cache, 4)
    B, H, T, _ = q_lat.shape
    return _split(_Latent(q_lat, q_pe, dtype), cache, softmax_scale, _n_new_list(n_new, B, T), recent, B, H, T,
                  q_lat.device, block=block, key_block=key_block, dtype=dtype)  # fmt: skip


class _PerHead:
    """Operands of the split path per head ("MHA form", as prefill runs in vLLM and SGLang): keys ``[W_UK c, k_pe]``
    (``Dn + Dr`` wide) and values ``W_UV c`` (``Dv``) up-projected from the workspace rows, queries ``[q_nope,
    q_pe]``; ``(Dn + Dr + Dv) / (Dc + Dr + Dc)`` of the latent form's products (320 / 1088 at DeepSeek widths) plus
    the up-projection, once per sequence (or per chunk of keys past :data:`PER_HEAD_KEYS` bytes). On CUDA every part
    goes through a fused attention kernel (:mod:`quantmla.kernels.fused_prefill`), the far keys one call per chunk
    of at most :data:`PER_HEAD_KEYS` bytes of up-projected keys and values, instead of score tiles."""

    per_head = True  # a fused kernel may run both parts (the CUDA memory-efficient one takes these widths)

    def __init__(self, q_nope, q_pe, w_uk, w_uv, dtype: torch.dtype) -> None:
        self.q_nope, self.q_pe, self.dtype = q_nope, q_pe, dtype
        self.w_uk, self.w_uv = w_uk.to(dtype), w_uv.to(dtype)  # [H, Dn, Dc], [H, Dv, Dc]
        self.dc, self.dv = w_uk.shape[2], w_uv.shape[1]

    def query(self, b: int, t0: int, t1: int) -> torch.Tensor:  # [H, t, Dn + Dr]
        return torch.cat([self.q_nope[b, :, t0:t1], self.q_pe[b, :, t0:t1]], dim=-1).to(self.dtype)

    def sequence(self, packed: torch.Tensor) -> None:
        H, n = self.w_uk.shape[0], packed.shape[0]
        per_key = H * (self.w_uk.shape[1] + packed.shape[1] - self.dc + self.dv) * packed.element_size()
        self.packed, self.kv = packed, None
        if n * per_key <= PER_HEAD_KEYS:
            self.kv = self.rows(packed)
        self.fused_keys = max(1, PER_HEAD_KEYS // per_key)  # far keys per fused call (up-projected per chunk)

    def far(self, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is not None:
            return self.kv[0][:, k0:k1], self.kv[1][:, k0:k1]
        return self.rows(self.packed[k0:k1])

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [S, Dc + Dr] -> [H, S, Dn + Dr], [H, S, Dv]
        c, r = x[:, : self.dc], x[:, self.dc :]  # contiguous products: the fused kernel wants unit last strides
        k_nope = c @ self.w_uk.transpose(1, 2)  # [H, S, Dn]
        k = torch.cat([k_nope, r[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
        return k, c @ self.w_uv.transpose(1, 2)  # [H, S, Dv]


def prefill_attention_heads(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
    n_new=None,
    *,
    recent: torch.Tensor | None = None,
    block: int | None = None,
    key_block: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The split path per head: ``q_nope [B, H, T, Dn]``, ``q_pe [B, H, T, Dr]``, ``W_UK [H, Dn, Dc]``, ``W_UV [H,
    Dv, Dc]`` -> ``o [B, H, T, Dv]`` fp32 (rows past ``n_new[b]`` are 0; contract:
    :func:`quantmla.kernels.reference.prefill_attention_heads_torch`). The same keys, copies and policy as
    :func:`prefill_attention_split` (scores ``q_nope . W_UK c = (q_nope W_UK) . c``, output ``W_UV sum p c``), with
    about 3.4x fewer multiply-adds in the attention products at DeepSeek widths. ``block``, ``key_block``,
    ``dtype``: as there (keys and values are up-projected in ``dtype``)."""
    _check_up(q_nope, q_pe, cache, w_uk, w_uv)
    B, H, T, _ = q_nope.shape
    ops = _PerHead(q_nope, q_pe, w_uk, w_uv, dtype)
    return _split(ops, cache, softmax_scale, _n_new_list(n_new, B, T), recent, B, H, T, q_nope.device, block=block,
                  key_block=key_block, dtype=dtype)  # fmt: skip
