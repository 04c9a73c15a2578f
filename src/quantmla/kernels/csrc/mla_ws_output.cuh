// The output warpgroups of the warp-specialized decode kernel (decode_mla_sm90_ws.cu, roles: mla_ws_cfg.cuh): output
// warpgroup j owns content groups 2j and 2j + 1 (256 channels) for all 32 heads and copies the pages' bytes it reads.
//
// Per tile: wait pfull[b]; rescale O by the score warpgroup's per-head factors when it says so; for each of its two
// groups and both 64-channel halves, O^T[64 ch x 32 heads] += codes^T (fp16 exact, ldmatrix.trans of the staged
// bytes: the wgmma kernel's output product and row permutation) x (P s_g 2^k)^T (P buffer b, K-major), 4 k-steps of
// 16 tokens; wgmma_wait<0>; arrive pempty[b]; WG-local barrier (its four warps are done with stage s); copy its part
// of page it + kStages into stage s (cp.async, then one cp.async-arrival on full[s] per thread).
// Epilogue (after the CTA barrier that publishes FIN): (O 2^-k + offset term) / l into the partial outputs.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"
#include "mla_ws_cfg.cuh"

namespace qmla {
namespace ws {

// Output WG j's part of page `page` into the stage at `stage`: the content chunks of its two groups (every token),
// then WG 0 the RoPE chunks (chunk-major, as load_page), WG 1 the meta rows; then one cp.async-arrival on `full`.
template <int CB, int RB>
__device__ __forceinline__ void copy_part(uint32_t stage, const uint8_t* page, const Params& p, int meta_rows, int j,
                                          int lt, uint32_t full) {
  using C = PageCfg<CB, RB>;
  constexpr int CX = C::CBYTES / 16, PER = kPage * CX / 2 / kWg;  // content chunks per thread
  static_assert(kPage * CX / 2 % kWg == 0, "copy split");
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int n = copy_token<CX>(lt, i), x = copy_chunk<CX>(j, lt, i);
    cp_async16(stage + C::C_SM + n * C::CBYTES + 16 * swizzled_chunk(x, n), page + p.c_off + n * C::CBYTES + 16 * x);
  }
  constexpr int NR = kPage * C::RCH;
  static_assert(NR <= kWg, "RoPE chunks: one per thread");
  if (j == 0) {
    if (lt < NR) {
      const int n = lt / C::RCH, xr = lt % C::RCH;
      cp_async16(stage + C::R_SM + xr * (kPage * 16) + n * 16, page + p.r_off + n * C::RBYTES + 16 * xr);
    }
  } else if (lt < meta_rows * kPage * 2 / 16) {
    cp_async16(stage + C::M_SM + 16 * lt, page + p.m_off + 16 * lt);
  }
  mbar_arrive_cp_async(full);
}

template <int CB, int RB, bool CSYM, bool RSYM>
__device__ __forceinline__ void output_role(const Params& p, uint8_t* smem, int j, int pg0, int pg1,
                                            const int* bt, long long row0, int h0) {
  using C = Cfg<CB, RB>;
  using M = MetaRows<CSYM, RSYM>;
  constexpr int NH = kNH, NC = C::NC, KB = C::KB, CPG = C::CPG, PS = C::PS;
  static_assert(CB == 4 || CB == 2, "4/2-bit content (the fp16 output product of the wgmma kernel)");
  const int lt = threadIdx.x - kWg * (1 + j), warp = lt >> 5, lane = lane_id(), g = lane >> 2, t = lane & 3;
  const uint32_t mbar = smem_u32(smem + C::MBAR);
  constexpr int kStageBytes = (C::STAGE + 127) / 128 * 128;
  const uint32_t st0 = smem_u32(smem + C::ST);
  const int vshift = CB * 2 * (warp / CPG);  // the two planes this warp's output rows take from each byte

  float oacc[4][NH / 2];  // [2 (group 2j + gl) + half][d]: O^T of this thread's rows / heads
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < NH / 2; ++k) oacc[i][k] = 0.f;

  for (int it = 0; pg0 + it < pg1; ++it) {
    const int pg = pg0 + it, s = it % kStages, pb = it & 1;
    const int blk_next = pg + kStages < pg1 ? bt[pg + kStages] : 0;  // read now, used after this tile
    mbar_wait(mbar + 8 * (kStages + pb), pfull_parity(it));
    const float* alpha = reinterpret_cast<const float*>(smem + C::ALPHA) + pb * NH;
    if (reinterpret_cast<const int*>(smem + C::ALPHA + 2 * NH * 4)[pb]) {
      float a[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) a[c] = alpha[head_of(c, t)];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri)
#pragma unroll
          for (int c = 0; c < NC; ++c) oacc[i][acc_idx(ri, c)] *= a[c];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operands(oacc[i]);

    const uint32_t st_u = st0 + s * kStageBytes;
    const Desc pdesc(wgmma_desc(smem_u32(smem + C::PT + pb * C::PTB), 128, 256));
    const int mi_v = lane >> 3;
    auto pv_addr = [&](int jb) -> uint32_t {  // tokens (2t, 2t+1) / (8+2t, 9+2t) of k-step 2kp, then of 2kp + 1
      const int gi = 2 * j + jb / 2, kp = jb % 2, chunk = out_chunk(CPG, gi, warp);
      const int tok = 16 * (2 * kp + (mi_v >> 1)) + 8 * (mi_v & 1) + (lane & 7);
      return st_u + C::C_SM + tok * C::CBYTES + 16 * swizzled_chunk(chunk, lane & 7);
    };
    uint32_t Rv[4];
    ldsm_x4_t(Rv[0], Rv[1], Rv[2], Rv[3], pv_addr(0));
#pragma unroll
    for (int jb = 0; jb < 4; ++jb) {  // batch jb: group 2j + jb / 2, k-steps 2 kp and 2 kp + 1 (kp = jb % 2)
      const int gl = jb / 2, gi = 2 * j + gl, kp = jb % 2;
      uint32_t R[4] = {Rv[0], Rv[1], Rv[2], Rv[3]};
      if (jb + 1 < 4) ldsm_x4_t(Rv[0], Rv[1], Rv[2], Rv[3], pv_addr(jb + 1));  // one batch ahead
#pragma unroll
      for (int i = 0; i < 4; ++i) R[i] >>= vshift;
      uint32_t a[2][2][4];
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const uint32_t r8a = R[2 * ks] >> 8, r8b = R[2 * ks + 1] >> 8;  // the upper byte's fields, in place
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // field (byte, plane hh): byte 0 -> row g, byte 1 -> row g + 8
          a[ks][hh][0] = code_f16<CB, kSub>(R[2 * ks], hh);
          a[ks][hh][1] = code_f16<CB, kSub>(r8a, hh);
          a[ks][hh][2] = code_f16<CB, kSub>(R[2 * ks + 1], hh);
          a[ks][hh][3] = code_f16<CB, kSub>(r8b, hh);
        }
      }
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          wgmma_f16_n32(oacc[2 * gl + hh], a[ks][hh], pdesc.at((gi * 4 + 2 * kp + ks) * KB), pdesc.hi);
      wgmma_commit();
      if (jb + 1 < 4) wgmma_wait<1>();  // the batch before this one is done: its A registers are free
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operands(oacc[i]);
    mbar_arrive(mbar + 8 * (kStages + 2 + pb));  // P buffer pb is free
    named_sync(kBarOut0 + j, kWg);                // this WG's four warps are done with stage s
    if (pg + kStages < pg1)
      copy_part<CB, RB>(st_u, p.pool + (long long)blk_next * p.page_bytes, p, M::ROWS, j, lt, mbar + 8 * s);
  }

  // ---- epilogue: wait for the score warpgroup's FIN (the caller's CTA barrier), then the partial outputs
  __syncthreads();
  const float* fin = reinterpret_cast<const float*>(smem + C::FIN);
  // 2^-k_run; kSub: times 2^24 and, per accumulator half hh, 2^-(CB hh) (its plane's factor)
  const float o_down[2] = {fin[5 * NH] * (kSub ? 0x1p24f : 1.f), fin[5 * NH] * (kSub ? exp2i(24 - CB) : 1.f)};
  float inv_l[NC], corr[2][NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int h = head_of(c, t);
    inv_l[c] = fin[h];
#pragma unroll
    for (int gl = 0; gl < 2; ++gl) corr[gl][c] = fin[NH + (2 * j + gl) * NH + h];
  }
#pragma unroll
  for (int gl = 0; gl < 2; ++gl)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int ch = out_channel(CPG, PS, 2 * j + gl, hh, warp, g);  // row ri = 0 (even channel); ri = 1: + 1
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int h = h0 + head_of(c, t);
        if (h < p.H) {
          const float v0 = fmaf(oacc[2 * gl + hh][acc_idx(0, c)], o_down[hh], corr[gl][c]) * inv_l[c];
          const float v1 = fmaf(oacc[2 * gl + hh][acc_idx(1, c)], o_down[hh], corr[gl][c]) * inv_l[c];
          *reinterpret_cast<float2*>(p.po + (row0 + h) * kDc + ch) = make_float2(v0, v1);
        }
      }
    }
}

}  // namespace ws
}  // namespace qmla
