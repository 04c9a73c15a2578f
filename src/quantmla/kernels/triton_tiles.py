"""The tile-level pieces of the Triton decode kernels (:mod:`quantmla.kernels.triton_decode`), as ``@triton.jit``
functions: codes to fp16 magic numbers (``1024 + c 2^sh``: mask a byte, OR the exponent bits of 1024), the
per-group scales and offsets of a packed tile, one packed or BF16 64-token tile of the score and output
products with its online-softmax update. The arithmetic is documented in triton_decode's module docstring.

Import this module only when the Triton path is wanted: it imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _magic(b16, MASK: tl.constexpr):
    """int16 bytes -> fp16 ``1024 + (byte & MASK)`` (exact)."""
    return ((b16 & MASK) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _grouped_codes(a, BITS: tl.constexpr):
    """int16 bytes ``[N, GB]`` of one quantization group (grouped planar packing) -> fp16 ``[N, GB * 8 / BITS]``
    ``1024 + code``, in the order of :func:`_group_perm` (4 bit: position ``2m + f`` = field ``f`` of byte ``m``;
    2 bit: position ``4m + 2x + y`` = field ``2y + x``). (One return per helper: Triton 3.6 rejects branches that
    return differently shaped tensors, even under a constexpr condition.)"""
    if BITS == 4:
        out = _grouped_codes4(a)
    else:
        out = _grouped_codes2(a)
    return out


@triton.jit
def _grouped_codes4(a):
    lo = ((a & 15) | 0x6400).to(tl.float16, bitcast=True)
    hi = (((a >> 4) & 15) | 0x6400).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [a.shape[0], a.shape[1] * 2])


@triton.jit
def _grouped_codes2(a):
    f0 = ((a & 3) | 0x6400).to(tl.float16, bitcast=True)
    f1 = (((a >> 2) & 3) | 0x6400).to(tl.float16, bitcast=True)
    f2 = (((a >> 4) & 3) | 0x6400).to(tl.float16, bitcast=True)
    f3 = (((a >> 6) & 3) | 0x6400).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(tl.join(f0, f1), tl.join(f2, f3)), [a.shape[0], a.shape[1] * 4])


@triton.jit
def _plane_pair(a, SH: tl.constexpr):
    """int16 bytes ``[N, GB]`` of one 2-bit group -> fp16 ``[N, 2 GB]`` ``1024 + code`` of its planes at bits
    ``SH`` and ``SH + 2`` (channels ``j`` and ``GB + j`` of the pair at positions ``2j`` and ``2j + 1``: the order
    of :func:`_group_perm` with ``BITS = 4``). C2 content whose groups hold two sub-tiles (latent 256, groups of
    128: SmolLM2-MLA)."""
    lo = (((a >> SH) & 3) | 0x6400).to(tl.float16, bitcast=True)
    hi = (((a >> (SH + 2)) & 3) | 0x6400).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [a.shape[0], a.shape[1] * 2])


@triton.jit
def _group_perm(SUB: tl.constexpr, BITS: tl.constexpr):
    """Channel (within its group of ``SUB``) at each position of :func:`_grouped_codes`' output (identity for
    8-bit codes)."""
    k = tl.arange(0, SUB)
    if BITS == 4:
        return k // 2 + (SUB // 2) * (k % 2)
    if BITS == 2:
        r = k % 4
        return k // 4 + (SUB // 4) * (2 * (r % 2) + r // 2)
    return k


@triton.jit
def _softmax_update(acc, valid, m_i, l_i):
    """Masked online-softmax step (base 2): returns (p, alpha, m_new, l_new)."""
    acc = tl.where(valid[None, :], acc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(acc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(acc - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def _meta_vec(mptr, row, rows, valid, P: tl.constexpr):
    """fp32 [BLOCK_N]: meta row ``row`` for the tile's tokens (0 for invalid ones)."""
    return tl.load(mptr + row * P + rows, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _scale_pair(
    mptr, rows, valid, srow, orow, SYM: tl.constexpr, BITS: tl.constexpr, SH: tl.constexpr, P: tl.constexpr
):
    """(s', mo) of one sub-tile whose codes sit at bit ``SH``: x = s' * (1024 + c * 2^SH + mo)."""
    s = _meta_vec(mptr, srow, rows, valid, P) * (1.0 / (1 << SH))
    if SYM:
        mo = tl.zeros_like(s) - (1024.0 + (1 << (BITS - 1 + SH)))
    else:
        m = _meta_vec(mptr, orow, rows, valid, P)
        mo = tl.where(s > 0, m / tl.where(s > 0, s, 1.0), 0.0) - 1024.0
    return s, mo


@triton.jit
def _score_part(acc, q16, qsum, k, s, mo):
    d = tl.dot(q16, tl.trans(k))  # [BLOCK_H, BLOCK_N] fp32
    return acc + (d + qsum[:, None] * mo[None, :]) * s[None, :]


@triton.jit
def _out_part(o, f, p, alpha, k, s, mo):
    smax = tl.max(s, axis=0)
    inv = tl.where(smax > 0, 1.0 / tl.where(smax > 0, smax, 1.0), 0.0)
    pw = (p * (s * inv)[None, :]).to(tl.float16)  # [BLOCK_H, BLOCK_N]
    o = o * alpha[:, None] + tl.dot(pw, k) * smax
    f = f * alpha + tl.sum(pw.to(tl.float32) * mo[None, :], axis=1) * smax
    return o, f


@triton.jit
def _packed_tile(
    m_i, l_i, o0, o1, o2, o3, f0, f1, f2, f3,
    q0, q1, q2, q3, qs0, qs1, qs2, qs3, qrA, qrB, qsA, qsB,
    base8, mptr, rows, valid,
    C_OFF: tl.constexpr, R_OFF: tl.constexpr, P: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
    CBITS: tl.constexpr, CSYM: tl.constexpr, CG: tl.constexpr, CPG: tl.constexpr, CSROW: tl.constexpr,
    COROW: tl.constexpr,
    RBITS: tl.constexpr, RSYM: tl.constexpr, RG: tl.constexpr, RSROW: tl.constexpr, ROROW: tl.constexpr,
):  # fmt: skip
    # CG: the content scale group (meta rows), CPG: its packing group (layout.content_pack_group: where codes sit)
    SUB: tl.constexpr = DC // 4
    CB: tl.constexpr = DC * CBITS // 8  # packed content bytes per token
    RB: tl.constexpr = DR * RBITS // 8  # packed RoPE bytes per token (= RoPE plane width)
    cptr = base8 + C_OFF + rows[:, None] * CB + tl.arange(0, SUB)[None, :]  # [BLOCK_N, SUB]
    rptr = base8 + R_OFF + rows[:, None] * RB + tl.arange(0, RB)[None, :]  # [BLOCK_N, RB]
    # -- content codes -> k0..k3 (fp16, 1024 + c * 2^sh), shifts sh0..sh3
    if CBITS == 8:
        k0 = _magic(tl.load(cptr).to(tl.int16), 0xFF)
        k1 = _magic(tl.load(cptr + SUB).to(tl.int16), 0xFF)
        k2 = _magic(tl.load(cptr + 2 * SUB).to(tl.int16), 0xFF)
        k3 = _magic(tl.load(cptr + 3 * SUB).to(tl.int16), 0xFF)
        SH1: tl.constexpr = 0
        SH2: tl.constexpr = 0
        SH3: tl.constexpr = 0
    elif SUB == CPG:  # grouped planar packing, sub-tile i = group i = GB bytes, fields in _group_perm order
        GB: tl.constexpr = SUB * CBITS // 8
        gptr = base8 + C_OFF + rows[:, None] * CB + tl.arange(0, GB)[None, :]  # [BLOCK_N, GB]
        k0 = _grouped_codes(tl.load(gptr).to(tl.int16), CBITS)
        k1 = _grouped_codes(tl.load(gptr + GB).to(tl.int16), CBITS)
        k2 = _grouped_codes(tl.load(gptr + 2 * GB).to(tl.int16), CBITS)
        k3 = _grouped_codes(tl.load(gptr + 3 * GB).to(tl.int16), CBITS)
        SH1: tl.constexpr = 0
        SH2: tl.constexpr = 0
        SH3: tl.constexpr = 0
    elif CBITS == 2 and CPG == 2 * SUB:  # GB = SUB / 2 bytes per group: sub-tile i = two planes of group i // 2
        GB: tl.constexpr = SUB // 2
        gptr = base8 + C_OFF + rows[:, None] * CB + tl.arange(0, GB)[None, :]  # [BLOCK_N, GB]
        a01 = tl.load(gptr).to(tl.int16)  # group 0: sub-tile 0 = planes 0, 1; sub-tile 1 = planes 2, 3
        a23 = tl.load(gptr + GB).to(tl.int16)  # group 1: sub-tiles 2, 3
        k0 = _plane_pair(a01, 0)
        k1 = _plane_pair(a01, 4)
        k2 = _plane_pair(a23, 0)
        k3 = _plane_pair(a23, 4)
        SH1: tl.constexpr = 0
        SH2: tl.constexpr = 0
        SH3: tl.constexpr = 0
    else:  # groups of >= SUB * 8 / CBITS channels: each sub-tile is one bit field of SUB consecutive bytes
        GB: tl.constexpr = CPG * CBITS // 8  # bytes per packing group = width of a plane within the group
        M: tl.constexpr = (1 << CBITS) - 1
        F1: tl.constexpr = (SUB % CPG) // GB
        F2: tl.constexpr = ((2 * SUB) % CPG) // GB
        F3: tl.constexpr = ((3 * SUB) % CPG) // GB
        k0 = _magic(tl.load(cptr).to(tl.int16), M)
        k1 = _magic(tl.load(cptr + (SUB // CPG) * GB + (SUB % CPG) % GB).to(tl.int16), M << (CBITS * F1))
        k2 = _magic(tl.load(cptr + (2 * SUB // CPG) * GB + (2 * SUB % CPG) % GB).to(tl.int16), M << (CBITS * F2))
        k3 = _magic(tl.load(cptr + (3 * SUB // CPG) * GB + (3 * SUB % CPG) % GB).to(tl.int16), M << (CBITS * F3))
        SH1: tl.constexpr = CBITS * F1
        SH2: tl.constexpr = CBITS * F2
        SH3: tl.constexpr = CBITS * F3
    s0, mo0 = _scale_pair(mptr, rows, valid, CSROW, COROW, CSYM, CBITS, 0, P)
    s1, mo1 = _scale_pair(mptr, rows, valid, CSROW + SUB // CG, COROW + SUB // CG, CSYM, CBITS, SH1, P)
    s2, mo2 = _scale_pair(mptr, rows, valid, CSROW + 2 * SUB // CG, COROW + 2 * SUB // CG, CSYM, CBITS, SH2, P)
    s3, mo3 = _scale_pair(mptr, rows, valid, CSROW + 3 * SUB // CG, COROW + 3 * SUB // CG, CSYM, CBITS, SH3, P)
    acc = tl.zeros([q0.shape[0], rows.shape[0]], dtype=tl.float32)
    acc = _score_part(acc, q0, qs0, k0, s0, mo0)
    acc = _score_part(acc, q1, qs1, k1, s1, mo1)
    acc = _score_part(acc, q2, qs2, k2, s2, mo2)
    acc = _score_part(acc, q3, qs3, k3, s3, mo3)
    # -- RoPE (plain planar rows): two halves of DR/2 channels, each inside one RoPE group (the dispatch checks it):
    # 8 bit = the two halves of the byte row, 4 bit = the low and the high nibbles of the DR/2 bytes
    HR: tl.constexpr = DR // 2
    if RBITS == 8:
        hptr = base8 + R_OFF + rows[:, None] * RB + tl.arange(0, HR)[None, :]  # [BLOCK_N, HR]
        krA = _magic(tl.load(hptr).to(tl.int16), 0xFF)
        krB = _magic(tl.load(hptr + HR).to(tl.int16), 0xFF)
        SHB: tl.constexpr = 0
    else:
        ra = tl.load(rptr).to(tl.int16)
        krA = _magic(ra, 0x0F)
        krB = _magic(ra, 0xF0)
        SHB: tl.constexpr = 4
    srA, morA = _scale_pair(mptr, rows, valid, RSROW, ROROW, RSYM, RBITS, 0, P)
    srB, morB = _scale_pair(mptr, rows, valid, RSROW + HR // RG, ROROW + HR // RG, RSYM, RBITS, SHB, P)
    acc = _score_part(acc, qrA, qsA, krA, srA, morA)
    acc = _score_part(acc, qrB, qsB, krB, srB, morB)
    p, alpha, m_i, l_i = _softmax_update(acc, valid, m_i, l_i)
    o0, f0 = _out_part(o0, f0, p, alpha, k0, s0, mo0)
    o1, f1 = _out_part(o1, f1, p, alpha, k1, s1, mo1)
    o2, f2 = _out_part(o2, f2, p, alpha, k2, s2, mo2)
    o3, f3 = _out_part(o3, f3, p, alpha, k3, s3, mo3)
    return m_i, l_i, o0, o1, o2, o3, f0, f1, f2, f3


@triton.jit
def _bdot(a, b, acc, INTERP: tl.constexpr):
    """bf16 tensor-core dot; under TRITON_INTERPRET (whose bf16 dot is broken in triton 3.9) an fp32 one."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _bf16_tile(m_i, l_i, o0, o1, o2, o3, q0, q1, q2, q3, qr, crow, rrow, valid, DC: tl.constexpr,
               DR: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """One tile of BF16 tokens: ``crow``/``rrow`` [BLOCK_N] point at each token's content / RoPE values."""
    SUB: tl.constexpr = DC // 4
    cs = tl.arange(0, SUB)[None, :]
    vm = valid[:, None]
    k0 = tl.load(crow[:, None] + cs, mask=vm, other=0.0)
    k1 = tl.load(crow[:, None] + SUB + cs, mask=vm, other=0.0)
    k2 = tl.load(crow[:, None] + 2 * SUB + cs, mask=vm, other=0.0)
    k3 = tl.load(crow[:, None] + 3 * SUB + cs, mask=vm, other=0.0)
    kr = tl.load(rrow[:, None] + tl.arange(0, DR)[None, :], mask=vm, other=0.0)
    acc = tl.zeros([q0.shape[0], crow.shape[0]], dtype=tl.float32)
    acc = _bdot(q0, tl.trans(k0), acc, INTERP)
    acc = _bdot(q1, tl.trans(k1), acc, INTERP)
    acc = _bdot(q2, tl.trans(k2), acc, INTERP)
    acc = _bdot(q3, tl.trans(k3), acc, INTERP)
    acc = _bdot(qr, tl.trans(kr), acc, INTERP)
    p, alpha, m_i, l_i = _softmax_update(acc, valid, m_i, l_i)
    pb = p.to(tl.bfloat16)
    o0 = _bdot(pb, k0, o0 * alpha[:, None], INTERP)
    o1 = _bdot(pb, k1, o1 * alpha[:, None], INTERP)
    o2 = _bdot(pb, k2, o2 * alpha[:, None], INTERP)
    o3 = _bdot(pb, k3, o3 * alpha[:, None], INTERP)
    return m_i, l_i, o0, o1, o2, o3
