"""Fused Triton writer: quantize + pack incoming MLA tokens into their pages, BF16 copies into sink/local.

One program per (sequence, new token). For each path it reproduces :func:`quantmla.quant.quantize.quantize_codes`
bit for bit: fp32 group statistics, the offset rounded *down* and the scale rounded *up* to fp16 (round to
nearest, then one fp16 ulp towards the needed side, as ``torch.nextafter``) after saturating both to the finite
fp16 range, NaN groups flagged explicitly (GPU min/max skip NaN, torch's propagate it), IEEE division (``div_rn``),
round-half-to-even (the ``1.5 * 2^23`` trick, exact for |y| < 2^22; larger values are clamped anyway),
then the packing of :mod:`quantmla.kernels.layout` (content grouped planar: byte ``j`` of group ``g`` of a
``b``-bit row holds channel ``g*G + j + p*G/k`` in bits ``[p*b, (p+1)*b)``; RoPE plain planar: ``G = Dr``).
Tokens in the sequence's final local window are copied as
BF16 into the ring (only those, so that a long prefill chunk writes each ring slot exactly once); tokens
at positions below ``sink`` go into the sink buffer. With a query-aware rounding plan on the cache
(``PagedMLACache.rope_rounding``) the RoPE key's codes are those of
:func:`quantmla.quant.rounding.quantize_codes_feedback`, bit for bit (same scales and offsets).
Works on CUDA and under ``TRITON_INTERPRET=1``.

Import this module only when a Triton writer is wanted: it imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_RNE_MAGIC = 12582912.0  # 1.5 * 2^23
F16_MAX: tl.constexpr = tl.constexpr(65504.0)  # scale and offset saturate here (never inf), as in torch
NAN_F16_BITS: tl.constexpr = tl.constexpr(0x7E00)  # the one NaN a NaN group's scale/offset is stored as


@triton.jit
def _round_up_f16(x):
    """fp32 x >= 0 -> the smallest fp16 >= x (as the torch reference's nextafter step)."""
    r = x.to(tl.float16)
    rb = r.to(tl.int16, bitcast=True)
    rb = tl.where(r.to(tl.float32) < x, rb + 1, rb)
    return rb.to(tl.float16, bitcast=True)


@triton.jit
def _round_down_f16(x):
    """fp32 x -> the largest fp16 <= x."""
    r = x.to(tl.float16)
    rb = r.to(tl.int16, bitcast=True)
    down = tl.where(rb > 0, rb - 1, tl.where(rb == 0, -32767, rb + 1))  # -32767 == 0x8001 (-min subnormal)
    rb = tl.where(r.to(tl.float32) > x, down.to(tl.int16), rb)
    return rb.to(tl.float16, bitcast=True)


@triton.jit
def _write_path(
    x_ptr,  # first element of this token's row of the path (any float dtype)
    code_ptr,  # uint8 pointer: this token's packed row in its page
    meta_ptr,  # fp16 pointer: meta region of the page + slot (row r lives at meta_ptr + r * P)
    valid,  # scalar bool: is this (sequence, token) real
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PGROUP: tl.constexpr,  # packing group: GROUP (grouped planar, content) or D (plain planar, RoPE)
    SYM: tl.constexpr,
    SROW: tl.constexpr,
    OROW: tl.constexpr,
    P: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= D * BITS / 8
    FB_ptr,  # fp32 [D, D] feedback of a query-aware rounding plan (quantmla.quant.rounding; read when FEEDBACK)
    ORD_ptr,  # int32 [D] its channel order
    FEEDBACK: tl.constexpr,  # round in ORD's order, feeding each error forward (else round to nearest)
):
    K: tl.constexpr = 8 // BITS  # codes per byte = planes
    W: tl.constexpr = D // K  # plane width = packed bytes per token
    NG: tl.constexpr = D // GROUP
    QMAX_S: tl.constexpr = (1 << (BITS - 1)) - 1  # symmetric code range [-QMAX_S, QMAX_S]
    QMAX_A: tl.constexpr = (1 << BITS) - 1  # asymmetric code range [0, QMAX_A]
    pl = tl.arange(0, K)[:, None]  # [K, 1]
    j = tl.arange(0, WP)[None, :]  # [1, WP]
    inb = (j < W) & (pl < K)  # [K, WP]
    GB: tl.constexpr = PGROUP // K  # packed bytes per packing group (PGROUP = D: plain planar)
    ch = (j // GB) * PGROUP + (j % GB) + pl * GB  # channel of each (plane, byte): [K, WP]
    x = tl.load(x_ptr + ch, mask=(inb & valid) != 0, other=0.0).to(tl.float32)
    gid = ch // GROUP
    s_e = tl.zeros([K, WP], dtype=tl.float32)
    m_e = tl.zeros([K, WP], dtype=tl.float32)
    for gi in tl.static_range(NG):
        sel = inb & (gid == gi)
        # a NaN in the group makes its scale/offset NaN, as in torch (GPU min/max would skip the NaN)
        nan_g = tl.max(tl.max(tl.where(sel & (x != x), 1.0, 0.0), axis=1), axis=0) > 0.0
        nan16 = tl.full([], NAN_F16_BITS, tl.int16).to(tl.float16, bitcast=True)
        if SYM:
            amax = tl.max(tl.max(tl.where(sel, tl.abs(x), 0.0), axis=1), axis=0)
            s32 = tl.minimum(tl.maximum(tl.math.div_rn(amax, QMAX_S * 1.0), 1e-8), F16_MAX)  # saturate
            s16 = tl.where(nan_g, nan16, _round_up_f16(s32))
            tl.store(meta_ptr + (SROW + gi) * P, s16, mask=valid)
            s_e = tl.where(sel, s16.to(tl.float32), s_e)
        else:
            lo = tl.min(tl.min(tl.where(sel, x, float("inf")), axis=1), axis=0)
            hi = tl.max(tl.max(tl.where(sel, x, float("-inf")), axis=1), axis=0)
            o16 = tl.where(nan_g, nan16, _round_down_f16(tl.minimum(tl.maximum(lo, -F16_MAX), F16_MAX)))
            s32 = tl.minimum(tl.maximum(tl.math.div_rn(hi - o16.to(tl.float32), QMAX_A * 1.0), 1e-8), F16_MAX)
            s16 = tl.where(nan_g, nan16, _round_up_f16(s32))
            tl.store(meta_ptr + (SROW + gi) * P, s16, mask=valid)
            tl.store(meta_ptr + (OROW + gi) * P, o16, mask=valid)
            s_e = tl.where(sel, s16.to(tl.float32), s_e)
            m_e = tl.where(sel, o16.to(tl.float32), m_e)
    s_e = tl.where(inb, s_e, 1.0)
    if FEEDBACK:  # quantize_codes_feedback: one channel at a time in ORD's order, its error fed forward
        w = x
        qf = tl.zeros([K, WP], dtype=tl.float32)
        for t in range(D):
            c = tl.load(ORD_ptr + t)
            sel = inb & (ch == c)
            wc = tl.sum(tl.sum(tl.where(sel, w, 0.0), axis=1), axis=0)
            sc = tl.sum(tl.sum(tl.where(sel, s_e, 0.0), axis=1), axis=0)
            if SYM:
                yc = tl.math.div_rn(wc, sc)
                yc = tl.where(yc == yc, yc, 0.0)
                qc = tl.minimum(tl.maximum((yc + 12582912.0) - 12582912.0, -QMAX_S * 1.0), QMAX_S * 1.0)
                deq = qc * sc
            else:
                oc = tl.sum(tl.sum(tl.where(sel, m_e, 0.0), axis=1), axis=0)
                yc = tl.math.div_rn(wc - oc, sc)
                yc = tl.where(yc == yc, yc, 0.0)
                qc = tl.minimum(tl.maximum((yc + 12582912.0) - 12582912.0, 0.0), QMAX_A * 1.0)
                deq = qc * sc + oc
            e = wc - deq
            e = tl.where((e == e) & (tl.abs(e) < float("inf")), e, 0.0)  # a NaN group feeds nothing forward
            f = tl.load(FB_ptr + c * D + ch, mask=inb, other=0.0)
            w = w - e * f
            qf = tl.where(sel, qc, qf)
        q = qf
        if SYM:
            q = qf + (1 << (BITS - 1))
    elif SYM:
        y = tl.math.div_rn(x, s_e)
        y = tl.where(y == y, y, 0.0)  # NaN -> 0 (torch: nan_to_num), on every device
        q = (y + 12582912.0) - 12582912.0  # round half to even
        q = tl.minimum(tl.maximum(q, -QMAX_S * 1.0), QMAX_S * 1.0) + (1 << (BITS - 1))
    else:
        y = tl.math.div_rn(x - m_e, s_e)
        y = tl.where(y == y, y, 0.0)
        q = (y + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, 0.0), QMAX_A * 1.0)
    codes = q.to(tl.int32) << (pl * BITS)  # [K, WP]
    packed = tl.sum(codes, axis=0)  # disjoint bit fields: sum == or
    jj = tl.arange(0, WP)
    tl.store(code_ptr + jj, packed.to(tl.uint8), mask=((jj < W) & valid) != 0)


@triton.jit
def _to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic (the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _copy_bf16(x_ptr, dst_ptr, valid, D: tl.constexpr, DP: tl.constexpr):
    d = tl.arange(0, DP)
    m = ((d < D) & valid) != 0  # (`!= 0`: the interpreter mistypes tensor & scalar masks)
    x = tl.load(x_ptr + d, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_ptr + d, _to_bf16_rne(x), mask=m)


@triton.jit
def _writer_kernel(
    C,  # [B, T, DC]
    KP,  # [B, T, DR]
    POOL8,  # uint8 [num_pages, PAGE_BYTES]
    POOL16,  # fp16 view of the pool
    POOLBF,  # bf16 view of the pool
    BT,  # int32 [B, MAXP]
    START,  # int32 [B] position of new token 0
    NNEW,  # int32 [B] number of real new tokens
    SINKB,  # bf16 [B, SINK, DC + DR]
    LOCB,  # bf16 [B, LOCAL, DC + DR]
    RFB,  # fp32 [DR, DR]: the RoPE key's query-aware rounding feedback (read when RFEED)
    RORD,  # int32 [DR]: its channel order
    stride_cb,
    stride_ct,
    stride_kb,
    stride_kt,
    stride_bt,
    stride_sb,
    stride_lb,
    PAGE_BYTES: tl.constexpr,
    C_OFF: tl.constexpr,
    R_OFF: tl.constexpr,
    M_OFF: tl.constexpr,
    P: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    CBITS: tl.constexpr,
    CGROUP: tl.constexpr,
    CPGROUP: tl.constexpr,  # content packing group (layout.content_pack_group): CGROUP, or 128 for wider groups
    CSYM: tl.constexpr,
    CSROW: tl.constexpr,
    COROW: tl.constexpr,
    RBITS: tl.constexpr,
    RGROUP: tl.constexpr,
    RSYM: tl.constexpr,
    RSROW: tl.constexpr,
    ROROW: tl.constexpr,
    CWP: tl.constexpr,
    RWP: tl.constexpr,
    DCP: tl.constexpr,
    DRP: tl.constexpr,
    SINK: tl.constexpr,
    LOCAL: tl.constexpr,
    RFEED: tl.constexpr,  # the cache has a RoPE rounding plan (PagedMLACache.rope_rounding)
):
    b = tl.program_id(0)
    t = tl.program_id(1)
    n_new = tl.load(NNEW + b)
    valid = t < n_new
    pos = tl.load(START + b) + t
    page = tl.load(BT + b * stride_bt + pos // P, mask=valid, other=0).to(tl.int64)
    slot = pos % P
    x_c = C + b.to(tl.int64) * stride_cb + t * stride_ct
    x_r = KP + b.to(tl.int64) * stride_kb + t * stride_kt
    base8 = POOL8 + page * PAGE_BYTES
    meta = POOL16 + page * (PAGE_BYTES // 2) + M_OFF // 2 + slot
    if CBITS == 16:  # each path on its own: C4R16 / C16R4 keep one path in BF16 inside the page
        _copy_bf16(x_c, POOLBF + page * (PAGE_BYTES // 2) + C_OFF // 2 + slot * DC, valid, DC, CWP)
    else:
        _write_path(
            x_c, base8 + C_OFF + slot * (DC * CBITS // 8), meta, valid, DC, CBITS, CGROUP, CPGROUP, CSYM, CSROW,
            COROW, P, CWP, RFB, RORD, False,
        )  # fmt: skip
    if RBITS == 16:
        _copy_bf16(x_r, POOLBF + page * (PAGE_BYTES // 2) + R_OFF // 2 + slot * DR, valid, DR, RWP)
    else:
        _write_path(
            x_r, base8 + R_OFF + slot * (DR * RBITS // 8), meta, valid, DR, RBITS, RGROUP, DR, RSYM, RSROW, ROROW,
            P, RWP, RFB, RORD, RFEED,
        )  # fmt: skip
    if CBITS != 16 or RBITS != 16:  # a quantized format: BF16 copies of the sink and the final local window
        if SINK > 0:
            in_sink = valid & (pos < SINK)
            dst = SINKB + b.to(tl.int64) * stride_sb + pos * (DC + DR)
            _copy_bf16(x_c, dst, in_sink, DC, DCP)
            _copy_bf16(x_r, dst + DC, in_sink, DR, DRP)
        if LOCAL > 0:
            in_loc = valid & (pos >= tl.load(START + b) + n_new - LOCAL)
            dst = LOCB + b.to(tl.int64) * stride_lb + (pos % LOCAL) * (DC + DR)
            _copy_bf16(x_c, dst, in_loc, DC, DCP)
            _copy_bf16(x_r, dst + DC, in_loc, DR, DRP)


def _path_args(spec, width: int, srow: int, orow: int | None) -> tuple:
    if spec is None:
        return 16, width, False, 0, 0, triton.next_power_of_2(width)
    return (
        spec.bits,
        spec.group_size,
        spec.symmetric,
        srow,
        0 if orow is None else orow,
        triton.next_power_of_2(width * spec.bits // 8),
    )


MAX_TOKENS_PER_LAUNCH = 32768  # the grid's second dimension is limited to 65535 on CUDA
WARPS = 4  # per program (one token)
# with a RoPE rounding plan: each of the Dr sequential steps reduces across the program's warps three times, which
# fewer warps make cheaper (the results do not depend on it: every reduction is exact -- one value and zeros, min /
# max, disjoint bit fields). Measured (H100, writer_rounding_h100_warps.md): one layer's 32K-token C4R4 chunk 0.57 ms
# at 1 warp, 1.11 at 2, 1.47 at 4 (round to nearest: 0.33)
FEEDBACK_WARPS = 1


def write_triton(cache, c_kv: torch.Tensor, k_pe: torch.Tensor, start: list[int], n_new: list[int]) -> None:
    """Launch the writer for ``c_kv [B, T, Dc]``, ``k_pe [B, T, Dr]`` (pages already reserved by the cache).

    Long chunks go in launches of at most ``MAX_TOKENS_PER_LAUNCH`` tokens, in order; the local ring still ends
    up holding the final window (a later launch overwrites what an earlier one left in the slots it covers)."""
    B, T, Dc = c_kv.shape
    if T == 0 or B == 0:
        return
    step = MAX_TOKENS_PER_LAUNCH
    if T > step:
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            sub = [max(0, min(k, t1) - t0) for k in n_new]
            _write_launch(cache, c_kv[:, t0:t1], k_pe[:, t0:t1], [s + t0 for s in start], sub)
        return
    _write_launch(cache, c_kv, k_pe, start, n_new)


def _device_counts(cache, start: list[int], n_new: list[int], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """``start`` and ``n_new`` as int32 tensors on ``dev``. When every sequence gets the same count at the same
    offset from its stored length (every decode step), they are made on the device from ``cache.seq_lens``: a
    host-to-device copy from pageable memory synchronizes the stream, once per layer per step otherwise."""
    lens = cache.lengths()
    off = start[0] - lens[0] if lens else 0
    if len(set(n_new)) == 1 and all(s - n == off for s, n in zip(start, lens)) and cache.seq_lens.device == dev:
        return cache.seq_lens + off, torch.full((len(n_new),), n_new[0], dtype=torch.int32, device=dev)
    return torch.tensor(start, dtype=torch.int32, device=dev), torch.tensor(n_new, dtype=torch.int32, device=dev)


def _write_launch(cache, c_kv: torch.Tensor, k_pe: torch.Tensor, start: list[int], n_new: list[int]) -> None:
    B, T, Dc = c_kv.shape
    L = cache.layout
    fmt = cache.fmt
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    dev = c_kv.device
    start_t, nnew_t = _device_counts(cache, start, n_new, dev)
    c_args = _path_args(fmt.content, L.kv_lora_rank, L.content_scale_row, L.content_offset_row)
    r_args = _path_args(fmt.rope, L.rope_dim, L.rope_scale_row, L.rope_offset_row)
    sink = cache.sink
    local = cache.local
    plan = cache.rope_rounding  # set_rope_rounding refused plans for a BF16 RoPE key
    feed = plan is not None
    if feed:
        plan = plan.to(dev)
        r_fb, r_ord = plan.feedback, plan.order
    else:  # never read: any valid pointers
        r_fb, r_ord = nnew_t, nnew_t
    _writer_kernel[(B, T)](
        c_kv,
        k_pe,
        cache.pool,
        cache.pool.view(torch.float16),
        cache.pool.view(torch.bfloat16),
        cache.block_table,
        start_t,
        nnew_t,
        sink,
        local,
        r_fb,
        r_ord,
        c_kv.stride(0),
        c_kv.stride(1),
        k_pe.stride(0),
        k_pe.stride(1),
        cache.block_table.stride(0),
        sink.stride(0),
        local.stride(0),
        PAGE_BYTES=L.page_bytes,
        C_OFF=L.content_offset,
        R_OFF=L.rope_offset,
        M_OFF=L.meta_offset,
        P=L.page_size,
        DC=L.kv_lora_rank,
        DR=L.rope_dim,
        CBITS=c_args[0],
        CGROUP=c_args[1],
        CPGROUP=L.pack_group("content") or c_args[1],
        CSYM=c_args[2],
        CSROW=c_args[3],
        COROW=c_args[4],
        RBITS=r_args[0],
        RGROUP=r_args[1],
        RSYM=r_args[2],
        RSROW=r_args[3],
        ROROW=r_args[4],
        CWP=c_args[5],
        RWP=r_args[5],
        DCP=triton.next_power_of_2(L.kv_lora_rank),
        DRP=triton.next_power_of_2(L.rope_dim),
        SINK=sink.shape[1],
        LOCAL=local.shape[1],
        RFEED=feed,
        num_warps=FEEDBACK_WARPS if feed else WARPS,
        enable_fp_fusion=False,  # no FMA contraction: the arithmetic must round exactly as torch's
    )
