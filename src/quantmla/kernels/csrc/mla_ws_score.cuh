// The score warpgroup of the warp-specialized decode kernel (decode_mla_sm90_ws.cu, roles: mla_ws_cfg.cuh): per
// 64-token page, the score product, the softmax and the probabilities for the output warpgroups.
//
// Per tile (the wgmma kernel's score and softmax steps, decode_mla_sm90.cu, with 32 heads on N):
//   wait full[s]; S_g^T[64 x 32] per content group g and RoPE (m64n32k16, A = codes as fp16 magic numbers from
//   ldmatrix, B = q^T), S = sum_g s_g[t] S_g + o_g[t] qsum_g; tile maxima exchanged in the warpgroup (named barrier,
//   double-buffered); lazy running maximum; P = 2^(S 2^e - m); wait pempty[b]; bf16/fp16 (P s_g 2^k)^T tiles and the
//   per-head factor by which the output warpgroups rescale O (alpha 2^(k_new - k_old)) into P buffer b; arrive
//   pfull[b]. Row sums and the offset terms sum_t P o_g[t] stay per thread until the epilogue.
// Epilogue: per head 1 / l, the offset terms and 2^-k into FIN for the output warpgroups; log2-sum-exp to p.pl.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"
#include "mla_ws_cfg.cuh"

namespace qmla {
namespace ws {

template <int CB, int RB, bool CSYM, bool RSYM>
__device__ __forceinline__ void score_role(const Params& p, uint8_t* smem, int e, int pg0, int pg1, int lo, int hi,
                                           long long row0, int h0) {
  using C = Cfg<CB, RB>;
  using M = MetaRows<CSYM, RSYM>;
  constexpr int NH = kNH, NC = C::NC, KB = C::KB, NG = 4;
  constexpr int F = C::F, CPG = C::CPG, CX = C::CBYTES / 16;
  constexpr int RF = C::RF, RCH = C::RCH;
  const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id(), g = lane >> 2, t = lane & 3;
  const float* qb = reinterpret_cast<const float*>(smem + C::QB);
  const float two_e = exp2i(kSub ? e + 24 : e);  // (kSub: scores in 2^(-e - 24) units, subnormal codes)
  const Desc qdesc(wgmma_desc(smem_u32(smem + C::QT), 128, 256));
  const uint32_t mbar = smem_u32(smem + C::MBAR);  // full[kStages], pfull[2], pempty[2]

  float m_run[NC], l_run[NC], po[NG][NC];
  int k_run = 0;
  bool k_set = false;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    m_run[c] = -INFINITY;
    l_run[c] = 0.f;
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) po[gi][c] = 0.f;
  }

  for (int it = 0; pg0 + it < pg1; ++it) {
    const int pg = pg0 + it, s = it % kStages, pb = it & 1;
    mbar_wait(mbar + 8 * s, full_parity(it));
    const uint8_t* st = smem + C::ST + s * ((C::STAGE + 127) / 128 * 128);
    const uint32_t st_u = smem_u32(st);
    const __half* meta = reinterpret_cast<const __half*>(st + C::M_SM);
    const int tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;  // valid tokens: [tok_lo, tok_hi)
    const bool edge = tok_lo > 0 || tok_hi < kPage;

    // ---- (1) score product, 2^-e units: sacc[group][d], group 4 = RoPE
    float sacc[5][NH / 2];
#pragma unroll
    for (int gr = 0; gr < 5; ++gr) {
      float iv[NC];
      load_row<NC>(iv, qb + gr * NH + t * NC);
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) sacc[gr][acc_idx(ri, c)] = iv[c];
      fence_operands(sacc[gr]);
    }
    {
      const int mi = lane >> 3;
      const int tok = 16 * warp + 8 * (mi & 1) + (lane & 7);
      constexpr int NBC = CX / 2, NB = NBC + RCH / 2;
      auto qk_addr = [&](int j) -> uint32_t {  // token g / g+8 of chunk 2j, then of chunk 2j + 1
        return j < NBC ? st_u + C::C_SM + tok * C::CBYTES + 16 * ((2 * j + (mi >> 1)) ^ (lane & 7))
                       : st_u + C::R_SM + (2 * (j - NBC) + (mi >> 1)) * (kPage * 16) + tok * 16;  // chunk-major
      };
      uint32_t Rn[4];
      ldsm_x4(Rn[0], Rn[1], Rn[2], Rn[3], qk_addr(0));
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        uint32_t R[4] = {Rn[0], Rn[1], Rn[2], Rn[3]};
        if (j + 1 < NB) ldsm_x4(Rn[0], Rn[1], Rn[2], Rn[3], qk_addr(j + 1));  // one batch ahead
        if (j < NBC) {
          const int x = 2 * j;
          uint32_t a[2][F][4];
          score_frags<CB, kSub>(R, a);
          wgmma_fence();
#pragma unroll
          for (int hx = 0; hx < 2; ++hx) {
            const int xx = x + hx, gr = xx / CPG, c = xx % CPG;
#pragma unroll
            for (int pl = 0; pl < F; ++pl)
              wgmma_f16_n32(sacc[gr], a[hx][pl], qdesc.at((8 * gr + c * F + pl) * KB), qdesc.hi);
          }
          wgmma_commit();
          wgmma_wait<1>();  // the batch before this one is done: its A registers are free
        } else {
          const int x = 2 * (j - NBC);
          uint32_t a[2][RF][4];
          score_frags<RB, kSub>(R, a);
          wgmma_fence();
#pragma unroll
          for (int hx = 0; hx < 2; ++hx)
#pragma unroll
            for (int pl = 0; pl < RF; ++pl)
              wgmma_f16_n32(sacc[4], a[hx][pl], qdesc.at((32 + (x + hx) * RF + pl) * KB), qdesc.hi);
          if (x + 2 < RCH) {
            wgmma_commit();
            wgmma_wait<1>();
          }
        }
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int gr = 0; gr < 5; ++gr) fence_operands(sacc[gr]);

    // ---- (2) scores of this thread's tokens 16w + g + 8 ri and head columns c
    float sv[4][2], ov[4][2], rsv[2], rov[2];
    float sc[2][NC];
    bool tok_ok[2] = {true, true};
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      if (edge) tok_ok[ri] = tau >= tok_lo && tau < tok_hi;
      load_meta<CSYM, RSYM, M>(meta, tau, ri, sv, ov, rsv, rov);
    }
    {  // one FMA chain per score: the RoPE term, then per group the offset and the scaled product (q sums by row)
      float qs[NC];
      load_row<NC>(qs, qb + 5 * NH + 4 * NH + t * NC);
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri)
          sc[ri][c] = RSYM ? rsv[ri] * sacc[4][acc_idx(ri, c)] : fmaf(rsv[ri], sacc[4][acc_idx(ri, c)], rov[ri] * qs[c]);
#pragma unroll
      for (int gr = 0; gr < 4; ++gr) {
        load_row<NC>(qs, qb + 5 * NH + gr * NH + t * NC);
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
          for (int ri = 0; ri < 2; ++ri) {
            if (!CSYM) sc[ri][c] = fmaf(ov[gr][ri], qs[c], sc[ri][c]);
            sc[ri][c] = fmaf(sv[gr][ri], sacc[gr][acc_idx(ri, c)], sc[ri][c]);
          }
      }
      if (edge) {
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
          for (int ri = 0; ri < 2; ++ri) sc[ri][c] = tok_ok[ri] ? sc[ri][c] : -INFINITY;
      }
    }
    float* red = reinterpret_cast<float*>(smem + C::RED) + pb * NH * 4;  // [head][warp], double-buffered
    float* smx = reinterpret_cast<float*>(smem + C::SMX) + pb * 4;
    heads_max_to(red, sc, warp, g, t);
    warp_max_scale_to<4>(smx, sv, tok_ok, warp, lane);  // the tile's largest content scale (mla_swapab.cuh)
    named_sync(kBarScore, kWg);
    const float k_scale = p_exponent(smx, k_run, k_set);  // 2^(new k - old k) for the accumulators
    float mt[NC], alpha[NC];
    bool need[NC], any = false;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float4 m4 = head_row(red, c, t);
      mt[c] = fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w)) * two_e;
      need[c] = mt[c] > m_run[c] + kLazy;  // false for an empty tile (-inf)
      any |= need[c];
    }
    const bool rescale = __any_sync(0xffffffffu, any) || k_scale != 1.f;  // the same in every warp
#pragma unroll
    for (int c = 0; c < NC; ++c) alpha[c] = 1.f;
    if (rescale) {  // most tiles skip this (lazy maximum)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float m_new = need[c] ? mt[c] : m_run[c];
        alpha[c] = need[c] ? ex2(m_run[c] - m_new) : 1.f;  // 0 from -inf
        m_run[c] = m_new;
        l_run[c] *= alpha[c];
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) po[gi][c] *= alpha[c];
      }
    }
    float pv[2][NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float ms = m_run[c] == -INFINITY ? 0.f : m_run[c];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        pv[ri][c] = ex2(fmaf(sc[ri][c], two_e, -ms));
        l_run[c] += pv[ri][c];
      }
    }

    // ---- (3) P buffer pb: free once the output warpgroups are done with tile it - 2
    if (it >= 2) mbar_wait(mbar + 8 * (kStages + 2 + pb), pempty_parity(it));
    uint8_t* pbuf = smem + C::PT + pb * C::PTB;
    float* alpha_out = reinterpret_cast<float*>(smem + C::ALPHA) + pb * NH;
    if (rescale && warp == 0 && g == 0) {
#pragma unroll
      for (int c = 0; c < NC; ++c) alpha_out[head_of(c, t)] = alpha[c] * k_scale;
    }
    if (tid == 0) reinterpret_cast<int*>(smem + C::ALPHA + 2 * NH * 4)[pb] = rescale;
    const float p_up = exp2i(k_run);  // P s 2^k_run in fp16 (exact scaling, then the fp16 rounding)
    // (P s_g 2^k)^T of this warp's 16 tokens (k-step = warp): per group two stmatrix.x4.trans of 8 x 8 matrices
    // (head octet m, k-half ri), matrix i = 4 q + ... : m = 2 q + i / 2, ri = i % 2; lane (g, t) holds heads
    // 8 m + 2 t, + 1 of token g + 8 ri, which land in row (head) 2 t / 2 t + 1, element (token) g of the K-major
    // core matrix at m * 256 + ri * 128 (mla_wgmma.cuh's layout)
    const uint32_t p_row = smem_u32(pbuf) + p_store_row(warp, lane);
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      float s_[2], o_[2];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {  // an out-of-range token's meta may be anything (NaN): P = 0 is not enough
        s_[ri] = tok_ok[ri] ? sv[gi][ri] * p_up : 0.f;
        o_[ri] = tok_ok[ri] ? (CSYM ? -(float)(1 << (CB - 1)) * sv[gi][ri] : ov[gi][ri]) : 0.f;
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) po[gi][c] = fmaf(pv[0][c], o_[0], fmaf(pv[1][c], o_[1], po[gi][c]));
#pragma unroll
      for (int q = 0; q < NC / 4; ++q) {
        uint32_t r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = 2 * q + i / 2, ri = i % 2;
          r[i] = pack_f16(pv[ri][2 * m] * s_[ri], pv[ri][2 * m + 1] * s_[ri]);
        }
        stsm_x4_t(p_row + p_store_step(gi, q), r[0], r[1], r[2], r[3]);
      }
    }
    fence_proxy_async();  // the generic-proxy writes, before the output warpgroups' wgmma read them
    mbar_arrive(mbar + 8 * (kStages + pb));
  }

  // ---- epilogue: row sums and offset sums over g and the four warps -> FIN; log2-sum-exp
  float* lsum = reinterpret_cast<float*>(smem + C::LSUM);
  float* roff = reinterpret_cast<float*>(smem + C::ROFF);
  float* fin = reinterpret_cast<float*>(smem + C::FIN);  // [kNH] 1 / l, [4][kNH] offset terms, [1] 2^-k
  heads_sum_to(lsum, l_run, warp, g, t);
#pragma unroll
  for (int gi = 0; gi < NG; ++gi) heads_sum_to(roff + gi * NH * 4, po[gi], warp, g, t);
  named_sync(kBarScore, kWg);
  if (warp == 0 && g == 0) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int h = head_of(c, t);
      const float l = head_total(lsum, c, t);
      fin[h] = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) fin[NH + gi * NH + h] = head_total(roff + gi * NH * 4, c, t);
      if (h0 + h < p.H) p.pl[row0 + h0 + h] = l > 0.f ? m_run[c] + log2f(l) : -INFINITY;
    }
  }
  if (tid == 0) fin[5 * NH] = exp2i(-k_run);
}

}  // namespace ws
}  // namespace qmla
