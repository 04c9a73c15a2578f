"""Triton decode attention over the paged MLA cache: packed low-bit formats and the BF16 baseline.

Three launches. ``_decode_kernel``: one program per (sequence, split) handles *all* heads of that sequence
(``BLOCK_H`` = 16 rows of the ``mma`` tiles, heads along M) over a contiguous range of its pages (split-K /
flash-decoding). ``_buffers_kernel`` (quantized formats only): one program per (sequence, 64-token tile) of
the BF16 sink and local-window buffers. Each program keeps an online softmax (base 2) and writes a normalized
partial output and its log2-sum-exp; ``_combine_kernel`` merges the partials of a sequence into one global
softmax. Tokens in the packed range ``[sink, n - local)`` are read from the pages, every other valid token
from BF16, so all valid tokens share one softmax. The BF16 format runs ``_decode_kernel`` on BF16 pages
(``QUANT=False``): our baseline of the same design.

Dequantization happens in registers and costs two integer operations per code: a code ``c`` in bit field
``sh`` of its byte becomes the fp16 number ``1024 + c * 2^sh`` by masking the byte and OR-ing the exponent
bits of 1024 (``0x6400``), exact for every code. The group scale ``s`` and offset ``m`` are applied per token
outside the dot products, so the tensor cores multiply raw codes::

    x = c * s + m = s' * (k + mo),   k = 1024 + c * 2^sh,  s' = s * 2^-sh,  mo = m / s' - 1024
    score[h, n] += s'[n] * (q[h] . k[n] + mo[n] * sum(q[h]))           (q in fp16, fp32 accumulation)
    o[h]        += sum_n p[h, n] s'[n] (k[n] + mo[n])                    (p * s' / max s' in fp16)

The same reconstructed content tile ``k`` (registers) feeds the score product and the output product.
Performance note (H200, see docs/kernels.md): the BF16 kernel runs at 3.5-3.8 TB/s at batch 32; the packed
kernels are bound by the work around the tensor-core products (unpack, two operand-layout conversions of
each tile through shared memory, per-token scaling), not by memory, and reach only ~0.4 TB/s.
Symmetric specs use ``mo = -(1024 + 2^(bits-1) * 2^sh)``. Content is processed as four sub-tiles of
``Dc / 4`` channels (each inside one quantization group), RoPE as its bit planes.

Import this module only when the Triton path is wanted: it imports triton.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from quantmla.kernels.split_plan import packed_page_counts, split_plan
from quantmla.kernels.triton_tiles import _bf16_tile, _group_perm, _packed_tile

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr global: usable inside @triton.jit


@triton.jit
def _decode_kernel(
    QL, QP,  # [B, H, DC], [B, H, DR] (any float dtype)
    POOL8, POOL16, POOLBF,  # the page pool as uint8 / fp16 / bf16
    BT, LENS,  # int32 [B, MAXP], int32 [B]
    SINKB, LOCB,  # bf16 [B, SINK, DC + DR], [B, LOCAL, DC + DR]
    PO, PL,  # fp32 [B, NSPLIT_TOTAL, H, DC], [B, NSPLIT_TOTAL, H] (log2 units)
    qk_scale,  # softmax_scale * log2(e)
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_bt, stride_sb, stride_lb,
    H, NSPLIT, PPS, NS_TOTAL, SP_OFF,
    PAGE_BYTES: tl.constexpr, C_OFF: tl.constexpr, R_OFF: tl.constexpr, M_OFF: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    CBITS: tl.constexpr, CSYM: tl.constexpr, CG: tl.constexpr, CPG: tl.constexpr, CSROW: tl.constexpr,
    COROW: tl.constexpr,
    RBITS: tl.constexpr, RSYM: tl.constexpr, RG: tl.constexpr, RSROW: tl.constexpr, ROROW: tl.constexpr,
    SINK: tl.constexpr, LOCAL: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    SUB: tl.constexpr = DC // 4
    b = tl.program_id(0)
    sp = tl.program_id(1)
    n = tl.load(LENS + b)
    hs = tl.arange(0, BLOCK_H)
    hm = hs < H
    if QUANT and CPG == SUB:  # the packed sub-tiles hold their group's channels in _group_perm order
        cs = _group_perm(SUB, CBITS)[None, :]
    elif QUANT and CBITS == 2 and CPG == 2 * SUB:  # two planes per sub-tile, interleaved (_plane_pair)
        cs = _group_perm(SUB, 4)[None, :]
    else:
        cs = tl.arange(0, SUB)[None, :]
    qb = QL + b.to(tl.int64) * stride_qlb + hs[:, None] * stride_qlh + cs
    q0 = tl.load(qb, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale  # [BLOCK_H, SUB]
    q1 = tl.load(qb + SUB, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(qb + 2 * SUB, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale
    q3 = tl.load(qb + 3 * SUB, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale
    qpb = QP + b.to(tl.int64) * stride_qpb + hs[:, None] * stride_qph
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    o0 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    o1 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    o2 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    o3 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    f0 = tl.zeros([BLOCK_H], dtype=tl.float32)
    f1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    f2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    f3 = tl.zeros([BLOCK_H], dtype=tl.float32)
    if QUANT:
        lo = SINK
        hi = tl.maximum(n - LOCAL, SINK)
    else:
        lo = 0
        hi = n
    # this split's pages (the BF16 sink/local tokens have their own kernel, _buffers_kernel)
    pg0 = lo // P + sp * PPS
    pg1 = tl.minimum(pg0 + PPS, (hi + P - 1) // P)
    if QUANT:
        HR: tl.constexpr = DR // 2  # the two RoPE halves of _packed_tile
        qrA = tl.load(qpb + tl.arange(0, HR)[None, :], mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale
        h0 = q0.to(tl.float16)
        h1 = q1.to(tl.float16)
        h2 = q2.to(tl.float16)
        h3 = q3.to(tl.float16)
        hA = qrA.to(tl.float16)
        qs0 = tl.sum(h0.to(tl.float32), axis=1)
        qs1 = tl.sum(h1.to(tl.float32), axis=1)
        qs2 = tl.sum(h2.to(tl.float32), axis=1)
        qs3 = tl.sum(h3.to(tl.float32), axis=1)
        qsA = tl.sum(hA.to(tl.float32), axis=1)
        qrB = tl.load(qpb + HR + tl.arange(0, HR)[None, :], mask=hm[:, None], other=0.0)
        hB = (qrB.to(tl.float32) * qk_scale).to(tl.float16)
        qsB = tl.sum(hB.to(tl.float32), axis=1)
        for pg in range(pg0, pg1):
            page = tl.load(BT + b.to(tl.int64) * stride_bt + pg).to(tl.int64)
            base8 = POOL8 + page * PAGE_BYTES
            mptr = POOL16 + page * (PAGE_BYTES // 2) + M_OFF // 2
            for sb in tl.static_range(P // BLOCK_N):
                rows = sb * BLOCK_N + tl.arange(0, BLOCK_N)
                pos = pg * P + rows
                valid = (pos >= lo) & (pos < hi)
                m_i, l_i, o0, o1, o2, o3, f0, f1, f2, f3 = _packed_tile(
                    m_i, l_i, o0, o1, o2, o3, f0, f1, f2, f3,
                    h0, h1, h2, h3, qs0, qs1, qs2, qs3, hA, hB, qsA, qsB,
                    base8, mptr, rows, valid,
                    C_OFF, R_OFF, P, DC, DR, CBITS, CSYM, CG, CPG, CSROW, COROW, RBITS, RSYM, RG, RSROW, ROROW,
                )  # fmt: skip
    else:
        qr = tl.load(qpb + tl.arange(0, DR)[None, :], mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale
        b0 = q0.to(tl.bfloat16)
        b1 = q1.to(tl.bfloat16)
        b2 = q2.to(tl.bfloat16)
        b3 = q3.to(tl.bfloat16)
        br = qr.to(tl.bfloat16)
        for pg in range(pg0, pg1):
            page = tl.load(BT + b.to(tl.int64) * stride_bt + pg).to(tl.int64)
            pbase = POOLBF + page * (PAGE_BYTES // 2)
            for sb in tl.static_range(P // BLOCK_N):
                rows = sb * BLOCK_N + tl.arange(0, BLOCK_N)
                pos = pg * P + rows
                valid = (pos >= lo) & (pos < hi)
                crow = pbase + C_OFF // 2 + rows * DC
                rrow = pbase + R_OFF // 2 + rows * DR
                m_i, l_i, o0, o1, o2, o3 = _bf16_tile(
                    m_i, l_i, o0, o1, o2, o3, b0, b1, b2, b3, br, crow, rrow, valid, DC, DR, INTERP
                )
    # -- normalized partial output and its log2-sum-exp
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (b.to(tl.int64) * NS_TOTAL + sp + SP_OFF) * H + hs  # [BLOCK_H]
    tl.store(PL + row, lse, mask=hm)
    ob = PO + row[:, None] * DC + cs
    tl.store(ob, (o0 + f0[:, None]) * inv_l[:, None], mask=hm[:, None])
    tl.store(ob + SUB, (o1 + f1[:, None]) * inv_l[:, None], mask=hm[:, None])
    tl.store(ob + 2 * SUB, (o2 + f2[:, None]) * inv_l[:, None], mask=hm[:, None])
    tl.store(ob + 3 * SUB, (o3 + f3[:, None]) * inv_l[:, None], mask=hm[:, None])


@triton.jit
def _buffers_kernel(
    QL, QP, SINKB, LOCB, LENS, PO, PL, qk_scale,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_sb, stride_lb,
    H, NS_TOTAL, SP,
    BLOCK_N: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr,
    SINK: tl.constexpr, LOCAL: tl.constexpr, INTERP: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """The BF16 sink + local-window tokens of a quantized cache: one program per (sequence, 64-token tile), tile 0
    the sink buffer, tiles 1.. the local ring; tile ``t`` writes partial slot ``SP + t``. ``GDC``: let the next
    kernel of the stream start at once (programmatic dependent launch, sm_90; it waits for this one itself).

    Row-major tiles (heads along M): a transposed, unrolled variant and a 16-token sink tile made Triton 3.6 read
    out of bounds of shared memory (seen with compute-sanitizer)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    SUB: tl.constexpr = DC // 4
    b = tl.program_id(0)
    n = tl.load(LENS + b)
    hs = tl.arange(0, BLOCK_H)
    hm = hs < H
    cs = tl.arange(0, SUB)[None, :]
    qb = QL + b.to(tl.int64) * stride_qlb + hs[:, None] * stride_qlh + cs
    q0 = (tl.load(qb, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.bfloat16)  # [BLOCK_H, SUB]
    q1 = (tl.load(qb + SUB, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.bfloat16)
    q2 = (tl.load(qb + 2 * SUB, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.bfloat16)
    q3 = (tl.load(qb + 3 * SUB, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.bfloat16)
    qpb = QP + b.to(tl.int64) * stride_qpb + hs[:, None] * stride_qph + tl.arange(0, DR)[None, :]
    qr = (tl.load(qpb, mask=hm[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.bfloat16)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    o0 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    o1 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    o2 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    o3 = tl.zeros([BLOCK_H, SUB], dtype=tl.float32)
    idx = tl.arange(0, BLOCK_N)
    t = tl.program_id(1)  # tile 0: the sink buffer; tiles 1..: the local ring
    svalid = ((idx < tl.minimum(n, SINK)) & (t == 0)) != 0  # (`!= 0`: interpreter mask typing)
    li = (t - 1) * BLOCK_N + idx
    pos = n - LOCAL + li
    lvalid = ((li >= 0) & (li < LOCAL) & (pos >= SINK) & (pos >= 0) & (t > 0)) != 0
    srow = SINKB + b.to(tl.int64) * stride_sb + tl.where(svalid, idx, 0) * (DC + DR)
    lrow = LOCB + b.to(tl.int64) * stride_lb + (tl.where(lvalid, pos, 0) % tl.maximum(LOCAL, 1)) * (DC + DR)
    crow = tl.where(t == 0, srow, lrow)
    valid = svalid | lvalid
    m_i, l_i, o0, o1, o2, o3 = _bf16_tile(m_i, l_i, o0, o1, o2, o3, q0, q1, q2, q3, qr, crow, crow + DC, valid,
                                          DC, DR, INTERP)  # fmt: skip
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    row = (b.to(tl.int64) * NS_TOTAL + SP + t) * H + hs
    tl.store(PL + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=hm)
    ob = PO + row[:, None] * DC + cs
    tl.store(ob, o0 * inv_l[:, None], mask=hm[:, None])
    tl.store(ob + SUB, o1 * inv_l[:, None], mask=hm[:, None])
    tl.store(ob + 2 * SUB, o2 * inv_l[:, None], mask=hm[:, None])
    tl.store(ob + 3 * SUB, o3 * inv_l[:, None], mask=hm[:, None])


@triton.jit
def _combine_kernel(PO, PL, O, LSE, H, NS, DC: tl.constexpr, DCP: tl.constexpr, NSP: tl.constexpr):
    """o[b, h] = sum_s w_s * po[b, s, h] with w_s = exp2(lse_s - lse), lse = log2 sum_s exp2(lse_s)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, NSP)
    lses = tl.load(PL + (b.to(tl.int64) * NS + ss) * H + h, mask=ss < NS, other=float("-inf"))
    mx = tl.max(lses, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    wsum = tl.sum(tl.exp2(lses - mx_safe), axis=0)
    d = tl.arange(0, DCP)
    acc = tl.zeros([DCP], dtype=tl.float32)
    for s in range(NS):
        ls = tl.load(PL + (b.to(tl.int64) * NS + s) * H + h)
        w = tl.exp2(ls - mx_safe)
        po = tl.load(PO + ((b.to(tl.int64) * NS + s) * H + h) * DC + d, mask=d < DC, other=0.0)
        acc += tl.where(w > 0, w * po, 0.0)
    has = wsum > 0
    acc = acc * tl.where(has, 1.0 / tl.where(has, wsum, 1.0), 0.0)
    tl.store(O + (b.to(tl.int64) * H + h) * DC + d, acc, mask=d < DC)
    tl.store(LSE + b * H + h, tl.where(has, (mx + tl.log2(tl.where(has, wsum, 1.0))) * LN2, float("-inf")))


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# tuning knobs (the benchmark may override them). Measured on the H200 (benchmarks/results/decode_h200*.md):
# 8 warps; 3 pipeline stages for the packed kernel, 2 for BF16; up to 4 programs per SM. ``resident``: programs
# of the kernel that run on one SM at once, for default_num_splits' rounding to whole waves (None: no rounding).
# BF16: 2 -- Triton 3.6 (the H200's) builds it for sm_90 with 128 registers x 256 threads and 94 KB of shared
# memory (benchmarks/compile_decode.py), and the split counts of decode_vs_flashmla_h200_bf16_splits.md time as 2
# per SM predicts (Triton 3.9 takes 136 registers: 1 per SM, where the rounding still picks near-whole waves).
TUNING = {"waves": 4.0, "min_pages": 4, "full_pages": 16, "block_n": 64, "num_warps": 8, "num_stages": 3,
          "resident": None}  # fmt: skip
TUNING_BF16 = dict(TUNING, num_stages=2, resident=2)  # the BF16 kernel's own settings
WAVE_GAIN = 0.95  # round to whole waves only where that is estimated >= 5% faster


def default_num_splits(batch: int, max_pages: int, device: torch.device, tuning: dict | None = None,
                       sms: int | None = None) -> int:  # fmt: skip
    """Split-K factor.

    At most ``waves`` programs per SM in total. Within that, a split covers ``full_pages`` pages once the splits
    alone fill one wave, but never more than ``min_pages`` pages while they would not: one program walks its
    pages serially (a few microseconds each), while many tiny splits cost partial writes and a long combine.
    On the H200, batch 1 at 128K: 512 splits of 4 pages took 212 us, 128 splits of 16 pages 90 us; batch 1 at
    1K: 1 split of 16 pages 53 us, 4 splits of 4 pages 20 us.

    Then, where ``tuning["resident"]`` says how many programs share an SM and the programs fill more than one
    wave of them, fewer splits where the last wave would run nearly empty: the call takes about (waves) x (pages
    per split), so the count with the least of that (the fewest splits among equals) replaces the first choice
    when it is estimated ``WAVE_GAIN`` faster. BF16 pages, H200, batch 32: 17 splits fill 2.06 waves of 264
    programs (3 waves of 121 pages at 128K); 8 splits one wave of 256 pages: 1154 us instead of 1381 at 128K,
    310 instead of 322 at 32K (decode_vs_flashmla_h200_bf16_splits.md)."""
    t = tuning or TUNING
    sms = sms or _num_sms(device)
    b = max(1, batch)
    fill = max(1, math.ceil(t["waves"] * sms / b))
    one_wave = min(math.ceil(sms / b), math.ceil(max_pages / t["min_pages"]))
    ns = max(1, min(fill, max(math.ceil(max_pages / t["full_pages"]), one_wave)))
    slots = (t.get("resident") or 0) * sms
    if slots and b * ns > slots and max_pages > 1:

        def cost(n: int) -> int:  # waves x pages per split
            return math.ceil(b * n / slots) * math.ceil(max_pages / n)

        best = min(range(1, ns + 1), key=lambda n: (cost(n), n))
        if cost(best) <= WAVE_GAIN * cost(ns):
            ns = best
    return ns


def plan_num_splits(cache, max_pages: int, device: torch.device, tuning: dict, sms: int | None = None) -> int:
    """The split count of a launch: :func:`default_num_splits` for the longest (planned) sequence, except for a
    ragged batch on a kernel whose resident programs per SM are known (``tuning["resident"]``: the BF16 kernel), which
    gets the plan for its own lengths that the CUDA kernels use (:func:`~quantmla.kernels.split_plan.split_plan`, one
    program per split and sequence, all heads): the longest sequences take more splits so that they finish with the
    short ones. (Equal lengths keep the measured count; splits past a sequence's pages write an empty partial.)"""
    slots = (tuning.get("resident") or 0) * (sms or _num_sms(device))
    if slots and not cache.fmt.is_quantized:
        pages = packed_page_counts(tuple(cache.plan_lengths()), 0, 0, cache.layout.page_size)
        if pages and pages[0] != pages[-1]:
            return split_plan(pages, 1, slots)
    return default_num_splits(cache.batch, max_pages, device, tuning, sms=sms)


def _spec_args(spec, width: int, srow: int, orow: int | None) -> tuple:
    if spec is None:
        return 16, False, width, 0, 0
    return spec.bits, spec.symmetric, spec.group_size, srow, 0 if orow is None else orow


def decode_attention_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    return_lse: bool = False,
    workspace: dict | None = None,
):
    """Triton decode attention; same contract as :func:`quantmla.kernels.reference.decode_attention_torch`.

    Heads are processed in groups of at most ``MAX_HEADS`` per launch (the kernels keep a ``[heads, Dc]`` tile
    per program, which for 128 heads does not fit in shared memory)."""
    from quantmla.kernels.reference import _check_q

    _check_q(q_lat, q_pe, cache, 3)
    H = q_lat.shape[1]
    if H > MAX_HEADS:
        parts = [
            _decode_heads(q_lat[:, h : h + MAX_HEADS], q_pe[:, h : h + MAX_HEADS], cache, softmax_scale, num_splits)
            for h in range(0, H, MAX_HEADS)
        ]
        out, lse = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    else:
        out, lse = _decode_heads(q_lat, q_pe, cache, softmax_scale, num_splits)
    return (out, lse) if return_lse else out


MAX_HEADS = 64  # heads per launch


def launch_splits(cache, device: torch.device, num_splits: int | None = None) -> tuple[int, int]:
    """(splits per sequence, pages per split) of the page kernel's launch: ``num_splits`` if given, else
    :func:`plan_num_splits`, at most one split per page of the longest (planned) sequence."""
    max_pages = max(1, math.ceil(cache.plan_longest() / cache.layout.page_size))
    tun = TUNING if cache.fmt.is_quantized else TUNING_BF16
    ns = max(1, min(num_splits or plan_num_splits(cache, max_pages, device, tun), max_pages))
    pps = math.ceil(max_pages / ns)
    return math.ceil(max_pages / pps), pps


def _decode_heads(q_lat, q_pe, cache, softmax_scale: float, num_splits: int | None):
    """One launch sequence (pages, BF16 buffers, combine) for ``H <= MAX_HEADS`` heads -> (out, lse)."""
    B, H, Dc = q_lat.shape
    L = cache.layout
    fmt = cache.fmt
    P = L.page_size
    Dr = L.rope_dim
    quant = fmt.is_quantized
    tun = TUNING if quant else TUNING_BF16
    ns, pps = launch_splits(cache, q_lat.device, num_splits)
    ns_total = ns + buffer_tiles(cache)
    dev = q_lat.device
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    po = torch.empty(B, ns_total, H, Dc, dtype=torch.float32, device=dev)
    pl = torch.empty(B, ns_total, H, dtype=torch.float32, device=dev)
    if B == 0 or H == 0:
        return torch.empty(B, H, Dc, device=dev), torch.empty(B, H, device=dev)
    c = _spec_args(fmt.content, Dc, L.content_scale_row, L.content_offset_row)
    r = _spec_args(fmt.rope, Dr, L.rope_scale_row, L.rope_offset_row)
    block_n = min(tun["block_n"], P)
    args = (
        q_lat, q_pe,
        cache.pool, cache.pool.view(torch.float16), cache.pool.view(torch.bfloat16),
        cache.block_table, cache.seq_lens, cache.sink, cache.local, po, pl,
        softmax_scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.block_table.stride(0), cache.sink.stride(0), cache.local.stride(0),
        H, ns, pps, ns_total,
    )  # fmt: skip
    consts = dict(
        PAGE_BYTES=L.page_bytes, C_OFF=L.content_offset, R_OFF=L.rope_offset, M_OFF=L.meta_offset,
        P=P, BLOCK_N=block_n, DC=Dc, DR=Dr, BLOCK_H=max(16, triton.next_power_of_2(H)),
        QUANT=quant,
        CBITS=c[0], CSYM=c[1], CG=c[2], CPG=L.pack_group("content") or c[2], CSROW=c[3], COROW=c[4],
        RBITS=r[0], RSYM=r[1], RG=r[2], RSROW=r[3], ROROW=r[4],
        SINK=cache.n_sink, LOCAL=cache.n_local,
        INTERP=os.environ.get("TRITON_INTERPRET") == "1",
    )  # fmt: skip
    # packed (or BF16) pages: one program per (sequence, split)
    _decode_kernel[(B, ns)](*args, 0, **consts, num_warps=tun["num_warps"], num_stages=tun["num_stages"])
    return finish_partials(q_lat, q_pe, cache, softmax_scale, po, pl, ns)


def buffer_tiles(cache) -> int:
    """Partial slots the BF16 sink/local buffers take (0 for a BF16 cache): the sink tile + the ring's tiles."""
    return 1 + math.ceil(cache.n_local / 64) if cache.fmt.is_quantized else 0


def finish_partials(q_lat, q_pe, cache, softmax_scale: float, po, pl, ns: int):
    """Given the page kernels' partials in slots ``[0, ns)`` of ``po [B, NS_TOTAL, H, Dc]`` / ``pl [B, NS_TOTAL, H]``
    (normalized output, log2-sum-exp), attend over the BF16 sink/local buffers into the remaining slots and merge
    all slots into one softmax -> ``(out [B, H, Dc] fp32, lse [B, H] natural log)``. Used by the CUDA kernel too."""
    attend_buffers(q_lat, q_pe, cache, softmax_scale, po, pl, ns)
    B, ns_total, H, Dc = po.shape
    out = torch.empty(B, H, Dc, dtype=torch.float32, device=po.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=po.device)
    _combine_kernel[(B, H)](
        po, pl, out, lse, H, ns_total, DC=Dc, DCP=triton.next_power_of_2(Dc), NSP=triton.next_power_of_2(ns_total),
        num_warps=4,
    )  # fmt: skip
    return out, lse


def attend_buffers(q_lat, q_pe, cache, softmax_scale: float, po, pl, ns: int, *, launch_dependents: bool = False
                   ) -> None:  # fmt: skip
    """Attention over the BF16 sink/local buffers into partial slots ``ns ..`` of ``po`` / ``pl``.
    ``launch_dependents`` (sm_90 only): the next kernel of the stream, launched programmatically, may start at once
    (:func:`quantmla.kernels.cuda_decode.launch_decode`'s one-stream order)."""
    B, ns_total, H, Dc = po.shape
    Dr = q_pe.shape[-1]
    if cache.n_sink > 64:
        raise ValueError(f"the decode kernels read the sink in one 64-token tile: sink={cache.n_sink} > 64")
    n_buf = ns_total - ns
    if n_buf:  # BF16 sink + local window: one program per (sequence, tile), partial slots ns ..
        _buffers_kernel[(B, n_buf)](
            q_lat, q_pe, cache.sink, cache.local, cache.seq_lens, po, pl, softmax_scale * LOG2E,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.sink.stride(0),
            cache.local.stride(0), H, ns_total, ns,
            BLOCK_N=64, DC=Dc, DR=Dr, BLOCK_H=max(16, triton.next_power_of_2(H)), SINK=cache.n_sink,
            LOCAL=cache.n_local, INTERP=os.environ.get("TRITON_INTERPRET") == "1", GDC=launch_dependents, num_warps=8,
        )  # fmt: skip
