// The output product of the Hopper decode kernel (decode_mla_sm90.cu), one 64-token tile:
//   O_(g,h)^T[64 channels x 16 heads] += codes_(g,h)^T (exact, fp16 or bf16) x (P s_g)^T
// for every content group g and 64-channel half h, 4 k-steps of 16 tokens, A = the codes from ldmatrix.trans of the
// staged page (register operand), B = the (P s)^T tiles the softmax wrote to shared memory (descriptor pdesc).
// Issued in batches of two k-steps, each batch waiting for the one before it (QMLA_SM90_PV_DEPTH) so that its A
// registers can be reused. The row order of the accumulators is described in decode_mla_sm90.cu's header. Also the
// softmax's side of the hand-over: the (P s)^T tiles and offset sums (write_p_tiles).
#pragma once

#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_sm90_ablate.cuh"
#include "mla_sm90_cfg.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"

namespace qmla {
namespace sm90 {

// 8-bit content (C8R8): a 16-bit element holds 2 channels; half h of group g takes chunk g * 8 + w + 4 h, codes as
// exact fp16 (SUB: the subnormals c 2^-24 as they are, the caller undoes 2^-24; else 1024 + c, then one HFMA2)
template <class C, int NH, bool SUB>
__device__ __forceinline__ void pv_product_c8(float (&oacc)[2 * C::NG][NH / 2], uint32_t st_u, const Desc& pdesc,
                                              int warp, int lane) {
  constexpr int NG = C::NG, CPG = C::CPG, kKBlock = C::KB;
  const int mi = lane >> 3;
#pragma unroll
  for (int gi = 0; gi < NG; ++gi) {
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {
      uint32_t a[2][2][4];  // [k-step of the pair][half]
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int tok = 16 * (2 * kp + ks) + 8 * (mi & 1) + (lane & 7);
        const int chunk = gi * CPG + warp + 4 * (mi >> 1);
        // (QMLA_SM90_ADDR_BASES: CPG = 8, so chunk ^ l = 8 gi + ((w + 4 (mi / 2)) ^ l): one base + constants)
        const uint32_t at = QMLA_SM90_ADDR_BASES
                                ? st_u + C::C_SM + (8 * (mi & 1) + (lane & 7)) * C::CBYTES +
                                      16 * ((warp + 4 * (mi >> 1)) ^ (lane & 7)) + 16 * (2 * kp + ks) * C::CBYTES +
                                      128 * gi
                                : st_u + C::C_SM + tok * C::CBYTES + 16 * (chunk ^ (lane & 7));
        uint32_t R[4];  // half 0: tokens (2t, 2t+1) / (8+2t, 9+2t); then half 1
        ldsm_x4_t(R[0], R[1], R[2], R[3], at);
        if constexpr ((kAblate & kAblateUnpack) != 0) {  // every fragment the raw words (mla_sm90_ablate.cuh)
          raw_frags(R, a);
          continue;
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // byte 0 -> row g, byte 1 -> row g + 8
          a[ks][hh][0] = code_f16_byte<SUB>(R[2 * hh], 0);
          a[ks][hh][1] = code_f16_byte<SUB>(R[2 * hh], 1);
          a[ks][hh][2] = code_f16_byte<SUB>(R[2 * hh + 1], 0);
          a[ks][hh][3] = code_f16_byte<SUB>(R[2 * hh + 1], 1);
        }
      }
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          product_f16<kAblateOutput, NH>(oacc[2 * gi + hh], a[ks][hh], pdesc.at((gi * 4 + 2 * kp + ks) * kKBlock),
                                         pdesc.hi);
      wgmma_commit();
      wgmma_wait<kPvDepth>();
    }
  }
}

// 4/2-bit content: each warp's output rows take two planes of every byte (the caller's vshift); Rv holds batches 0 ..
// LA - 1's ldmatrix.trans (issued before the P barrier), and each batch j loads batch j + LA's from addr(j + LA).
// F16OUT: codes as exact fp16 (1024 + 2^(b p) c, then one HFMA2; SUB: the subnormals 2^(b hh) c 2^-24 of plane hh, no
// HFMA2, the caller undoes the factor per accumulator), else exact bf16. TS (the T formats): one (P s)^T tile serves
// every group.
template <int CB, class C, int NH, bool F16OUT, bool TS, bool SUB, int LA, class Addr>
__device__ __forceinline__ void pv_product_packed(float (&oacc)[2 * C::NG][NH / 2], uint32_t (&Rv)[LA][4], int vshift,
                                                  Addr&& addr, const Desc& pdesc) {
  constexpr int NG = C::NG, F = C::F, kKBlock = C::KB;
#pragma unroll
  for (int j = 0; j < 2 * NG; ++j) {  // batch j: group j / 2, k-steps 2 kp and 2 kp + 1 (kp = j % 2)
    const int gi = j / 2, kp = j % 2, pt = TS ? 0 : gi;  // pt: the (P s)^T tile of group gi
    uint32_t R[4] = {Rv[j % LA][0], Rv[j % LA][1], Rv[j % LA][2], Rv[j % LA][3]};
    if (j + LA < 2 * NG) ldsm_x4_t(Rv[j % LA][0], Rv[j % LA][1], Rv[j % LA][2], Rv[j % LA][3], addr(j + LA));
#pragma unroll
    for (int i = 0; i < 4; ++i) R[i] >>= vshift;
    uint32_t a[2][2][4];
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if constexpr ((kAblate & kAblateUnpack) != 0) {  // every fragment the raw words (mla_sm90_ablate.cuh)
        raw_frags(R, a);
        break;
      } else if constexpr (F16OUT) {
        const uint32_t r8a = R[2 * ks] >> 8, r8b = R[2 * ks + 1] >> 8;  // the upper byte's fields, in place
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          a[ks][hh][0] = code_f16<CB, SUB>(R[2 * ks], hh);
          a[ks][hh][1] = code_f16<CB, SUB>(r8a, hh);
          a[ks][hh][2] = code_f16<CB, SUB>(R[2 * ks + 1], hh);
          a[ks][hh][3] = code_f16<CB, SUB>(r8b, hh);
        }
      } else {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          // field (byte, plane hh): byte 0 -> row g, byte 1 -> row g + 8
          a[ks][hh][0] = code<CB>(R[2 * ks], hh);
          a[ks][hh][1] = code<CB>(R[2 * ks], F + hh);
          a[ks][hh][2] = code<CB>(R[2 * ks + 1], hh);
          a[ks][hh][3] = code<CB>(R[2 * ks + 1], F + hh);
        }
      }
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if constexpr (F16OUT)
          product_f16<kAblateOutput, NH>(oacc[2 * gi + hh], a[ks][hh], pdesc.at((pt * 4 + 2 * kp + ks) * kKBlock),
                                         pdesc.hi);
        else
          product_bf16<kAblateOutput, NH>(oacc[2 * gi + hh], a[ks][hh], pdesc.at((pt * 4 + 2 * kp + ks) * kKBlock),
                                          pdesc.hi);
      }
    wgmma_commit();
    wgmma_wait<kPvDepth>();  // the batches before these are done: their A registers are free
  }
}

// The softmax's hand-over to the output product, per tile: bf16 / fp16 (P s_g 2^k)^T into the B tiles at pt (k-step =
// warp, k-half = token slot ri; NPT tiles: one per content group, or one for the T formats) and the offset sums
// po[g][c] += P o_g per thread. pv: P of this thread's tokens 16w + g + 8 ri and head columns c; sv / ov: their
// content scales / offsets; tok_ok: the token is in the tile's valid range (an out-of-range token's meta may be
// anything, NaN included: its scale and offset are taken as 0).
template <class C, int CB, int NH, int NPT, bool CSYM, bool kF16Out>
__device__ __forceinline__ void write_p_tiles(uint8_t* pt, const float (&pv)[2][NH / 4], const float (&sv)[4][2],
                                              const float (&ov)[4][2], const bool (&tok_ok)[2], float p_up,
                                              float (&po)[C::NG][NH / 4], int warp, int lane) {
  constexpr int NC = NH / 4, kKBlock = C::KB;
  const int g = lane >> 2, t = lane & 3;
  // QMLA_SM90_P_STSM: the tile of group gi with one stmatrix.x4.trans (mla_wgmma.cuh p_tile_row), else value by value
  constexpr bool kStsm = kF16Out && QMLA_SM90_P_STSM;
  const uint32_t prow = smem_u32(pt) + p_tile_row(kKBlock, warp, lane);
#pragma unroll
  for (int gi = 0; gi < NPT; ++gi) {
    float sp[2];  // P s (2^k_run) per token slot ri
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const float svg = sv[gi][ri], ovg = ov[gi][ri];
      // an out-of-range token's meta may be anything (NaN): P = 0 is not enough
      const float s = tok_ok[ri] ? svg : 0.f;
      const float o = tok_ok[ri] ? (CSYM ? -(float)(1 << (CB - 1)) * svg : ovg) : 0.f;
      sp[ri] = s * p_up;
      uint8_t* tile = pt + (gi * 4 + warp) * kKBlock + ri * 128 + g * 2;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        po[gi][c] = fmaf(pv[ri][c], o, po[gi][c]);
        if constexpr (kStsm) continue;
        const int h = head_of(c, t);
        uint8_t* at = tile + (h >> 3) * 256 + (h & 7) * 16;
        if constexpr (kF16Out)
          *reinterpret_cast<__half*>(at) = __float2half_rn(pv[ri][c] * sp[ri]);
        else
          *reinterpret_cast<__nv_bfloat16*>(at) = __float2bfloat16_rn(pv[ri][c] * sp[ri]);
      }
    }
    if constexpr (kStsm) {  // matrix ri + 2 hb: tokens 16w + 8 ri + g, heads 8 hb + 2t and + 1: c = 2 hb, 2 hb + 1
      const uint32_t x[4] = {pack_f16(pv[0][0] * sp[0], pv[0][1] * sp[0]),
                             pack_f16(pv[1][0] * sp[1], pv[1][1] * sp[1]),
                             pack_f16(pv[0][2] * sp[0], pv[0][3] * sp[0]),
                             pack_f16(pv[1][2] * sp[1], pv[1][3] * sp[1])};
      stsm_x4_t(prow + gi * 4 * kKBlock, x[0], x[1], x[2], x[3]);
    }
  }
}

}  // namespace sm90
}  // namespace qmla
