// BF16 pages on the Hopper swap-AB decode kernel (included by decode_mla_sm90.cu): the same structure as the packed
// kernel there -- one warpgroup per (16-head group, split, sequence), wgmma m64n16k16 with the page's 64 tokens on
// M and the heads on N, the page as the register A operand -- with nothing to unpack: ldmatrix of the staged bf16
// rows is the score product's A fragment (rows = tokens, k = channels) and ldmatrix.trans the output product's
// (rows = channels, k = tokens). No scales, offsets or sink/local buffers (a BF16 cache holds every token once).
//
// Staged page (one stage, 72 KB): token n's row = its 64 content chunks then its 8 RoPE chunks (16 bytes each),
// chunk x at n * 1152 + 16 * (x ^ (n & 7)) (conflict-free ldmatrix: rows are 288 words, a multiple of 32 banks).
// Score k-block kb = chunks 2 kb, 2 kb + 1 = channels 16 kb .. 16 kb + 15 (content, then RoPE from kb = 32): q^T is
// staged in channel order. Output M-block mb, row 16 w + r = channel 64 mb + 16 w + r.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"

namespace qmla {
namespace sm90 {

struct Bf16Cfg {
  static constexpr int kThreads = 128, kHeads = 16, kKBlock = kHeads * 32;
  static constexpr int CX = kDc * 2 / 16, RX = kDr * 2 / 16, ROW = 16 * (CX + RX);  // 64 + 8 chunks, 1152 B
  static constexpr int STAGE = kPage * ROW;           // 73,728 B
  static constexpr int PT = 2 * STAGE;                 // P^T [k-step][k-block] bf16
  static constexpr int RED = PT + 4 * kKBlock;         // [head][warp] floats: tile maxima, row sums
  static constexpr int QT = RED + kHeads * 4 * 4;      // q^T [36][k-block] bf16
  static constexpr int SMEM = QT + 36 * kKBlock;       // 168,192 B: one CTA per SM
  static_assert(kHeads * (kDc + kDr) * 2 <= STAGE, "q staging fits in stage 1");
};

__global__ void __launch_bounds__(Bf16Cfg::kThreads, 1) decode_kernel_sm90_bf16(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using C = Bf16Cfg;
  constexpr int kHeads = C::kHeads, kThreads = C::kThreads, kKBlock = C::kKBlock;
  extern __shared__ __align__(128) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem + C::RED);  // [head][warp]
  pdl_launch_dependents();  // the split merge may launch now (QMLA_PDL; it waits for this grid to finish)
  const int hg = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int h0 = hg * kHeads;
  const int n = p.lens[b];
  const int lo = p.sink;  // 0 for a BF16 cache (no buffers); kept general
  const int hi = max(n - p.local, p.sink);
  const int pg0 = lo / kPage + sp * p.pps;
  const int pg1 = min(pg0 + p.pps, (hi + kPage - 1) / kPage);
  if (empty_split(pg0, pg1)) return;  // a split without pages: nothing to write, the merge skips it (launched normally)

  const int* bt = p.block_table + (long long)b * p.bt_stride;
  auto issue = [&](int blk, int st) {  // 64 x 72 chunks, 36 per thread; consecutive threads on consecutive chunks
    const uint8_t* page = p.pool + (long long)blk * p.page_bytes;  // blk: the page's block-table entry
    const uint32_t dst = smem_u32(smem + st * C::STAGE);
#pragma unroll 4
    for (int i = tid; i < kPage * (C::CX + C::RX); i += kThreads) {
      const int tok = i / (C::CX + C::RX), x = i % (C::CX + C::RX);
      const uint8_t* src = x < C::CX ? page + p.c_off + tok * (kDc * 2) + 16 * x
                                     : page + p.r_off + tok * (kDr * 2) + 16 * (x - C::CX);
      cp_async16(dst + tok * C::ROW + 16 * (x ^ (tok & 7)), src);
    }
  };
  if (pg0 < pg1) issue(bt[pg0], 0);
  cp_async_commit();
  int blk_next = pg0 + 1 < pg1 ? bt[pg0 + 1] : 0;  // read a tile before its use

  // ---- q: bf16(q * qk_scale) staged in stage 1, then q^T in the k-block layout (a permutation of bf16 values)
  __nv_bfloat16* qst = reinterpret_cast<__nv_bfloat16*>(smem + C::STAGE);
  (void)stage_q<kHeads, kThreads, true>(qst, red, p, b, h0);  // bf16 has fp32's range: no exponent needed
  for (int r = tid; r < 36 * kHeads * 2; r += kThreads) {
    const int kb = r / (2 * kHeads), h = (r >> 1) % kHeads, kh = r & 1;
    *reinterpret_cast<uint4*>(smem + C::QT + kb * kKBlock + kblock_offset(8 * kh, h)) =
        *reinterpret_cast<const uint4*>(qst + h * (kDc + kDr) + 16 * kb + 8 * kh);
  }
  fence_proxy_async();
  __syncthreads();

  const Desc qdesc(wgmma_desc(smem_u32(smem + C::QT), 128, 256)), pdesc(wgmma_desc(smem_u32(smem + C::PT), 128, 256));
  float oacc[8][8];  // [M-block of 64 channels][d]
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) oacc[i][j] = 0.f;
  float m_run[4], l_run[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    m_run[c] = -INFINITY;
    l_run[c] = 0.f;
  }
  const int mi = lane >> 3;

  for (int it = 0; pg0 + it < pg1; ++it) {
    const int pg = pg0 + it;
    cp_async_wait<0>();
    __syncthreads();
    if (pg + 1 < pg1) issue(blk_next, (it + 1) & 1);
    cp_async_commit();
    if (pg + 2 < pg1) blk_next = bt[pg + 2];
    const uint32_t st_u = smem_u32(smem + (it & 1) * C::STAGE);
    const int tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;  // valid tokens: [tok_lo, tok_hi)
    const bool edge = tok_lo > 0 || tok_hi < kPage;
    if (edge) {  // tokens outside [tok_lo, tok_hi) hold whatever the pool holds (NaN too): their P is 0, but
      // 0 * NaN is NaN in the output product, so their content chunks are zeroed (uniform branch, edge tiles only)
      for (int i = tid; i < kPage * C::CX; i += kThreads) {
        const int tok = i / C::CX;
        if (tok < tok_lo || tok >= tok_hi)
          *reinterpret_cast<uint4*>(smem + (it & 1) * C::STAGE + tok * C::ROW + 16 * (i % C::CX)) =
              make_uint4(0, 0, 0, 0);
      }
      __syncthreads();
    }

    // ---- (1) scores S^T [64 tokens x 16 heads] in log2 units: 36 k-blocks, 4 per batch
    float sacc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sacc[i] = 0.f;
    fence_operands(sacc);
    {
      const int tok = 16 * warp + 8 * (mi & 1) + (lane & 7);
#pragma unroll
      for (int kb0 = 0; kb0 < 36; kb0 += 4) {
        uint32_t a[4][4];  // token g / g+8 of chunk 2kb, then of chunk 2kb + 1: exactly the A fragment
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int chunk = 2 * (kb0 + j) + (mi >> 1);
          ldsm_x4(a[j][0], a[j][1], a[j][2], a[j][3], st_u + tok * C::ROW + 16 * (chunk ^ (lane & 7)));
        }
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_bf16_n16(sacc, a[j], qdesc.at((kb0 + j) * kKBlock), qdesc.hi);
        wgmma_commit();
        wgmma_wait<1>();
      }
    }
    wgmma_wait<0>();  // also the previous tile's output product: O and the P tile are free
    fence_operands(sacc);
#pragma unroll
    for (int i = 0; i < 8; ++i) fence_operands(oacc[i]);

    // ---- (2) softmax over the tile's 64 rows per head (lazy running maximum, as in the packed kernels)
    bool tok_ok[2] = {true, true};
    float sc[2][4];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      if (edge) tok_ok[ri] = tau >= tok_lo && tau < tok_hi;
#pragma unroll
      for (int c = 0; c < 4; ++c) sc[ri][c] = tok_ok[ri] ? sacc[acc_idx(ri, c)] : -INFINITY;
    }
    heads_max_to(red, sc, warp, g, t);
    __syncthreads();
    float mt[4];
    bool need[4], any = false;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float4 m4 = head_row(red, c, t);
      mt[c] = fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w));
      need[c] = mt[c] > m_run[c] + kLazy;
      any |= need[c];
    }
    if (__any_sync(0xffffffffu, any)) {
      float alpha[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float m_new = need[c] ? mt[c] : m_run[c];
        alpha[c] = need[c] ? ex2(m_run[c] - m_new) : 1.f;
        m_run[c] = m_new;
        l_run[c] *= alpha[c];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri)
#pragma unroll
          for (int c = 0; c < 4; ++c) oacc[i][acc_idx(ri, c)] *= alpha[c];
    }
    uint8_t* tile = smem + C::PT + warp * kKBlock + g * 2;  // k-step = warp, k-half = ri, token % 8 = g
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float ms = m_run[c] == -INFINITY ? 0.f : m_run[c];
      const int h = head_of(c, t);
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const float pv = ex2(sc[ri][c] - ms);
        l_run[c] += pv;
        *reinterpret_cast<__nv_bfloat16*>(tile + ri * 128 + (h >> 3) * 256 + (h & 7) * 16) = __float2bfloat16_rn(pv);
      }
    }
    fence_proxy_async();
    __syncthreads();

    // ---- (3) output O^T [512 x 16] += V^T P^T: per M-block of 64 channels, 4 k-steps of 16 tokens
#pragma unroll
    for (int i = 0; i < 8; ++i) fence_operands(oacc[i]);
#pragma unroll
    for (int mb = 0; mb < 8; ++mb) {
      uint32_t a[4][4];  // [k-step]: rows g / g+8 = chunks 8mb + 2w / + 1, tokens (2t, 2t+1) / (8+2t, 9+2t)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int tok = 16 * ks + 8 * (mi >> 1) + (lane & 7);
        const int chunk = 8 * mb + 2 * warp + (mi & 1);
        ldsm_x4_t(a[ks][0], a[ks][1], a[ks][2], a[ks][3], st_u + tok * C::ROW + 16 * (chunk ^ (lane & 7)));
      }
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_bf16_n16(oacc[mb], a[ks], pdesc.at(ks * kKBlock), pdesc.hi);
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();  // (without it ptxas serializes every wgmma of this kernel: C7514)
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 8; ++i) fence_operands(oacc[i]);

  // ---- epilogue: row sums over g and the four warps; normalized partial output, log2-sum-exp
  __syncthreads();
  heads_sum_to(red, l_run, warp, g, t);
  __syncthreads();
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
  float inv_l[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int h = head_of(c, t);
    const float l = head_total(red, c, t);
    inv_l[c] = l > 0.f ? 1.f / l : 0.f;
    if (warp == 0 && g == 0 && h0 + h < p.H) p.pl[row0 + h0 + h] = l > 0.f ? m_run[c] + log2f(l) : -INFINITY;
  }
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int ch = 64 * mb + 16 * warp + g + 8 * ri;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = h0 + head_of(c, t);
        if (h < p.H) p.po[(row0 + h) * kDc + ch] = oacc[mb][acc_idx(ri, c)] * inv_l[c];
      }
    }
#endif
}

}  // namespace sm90
}  // namespace qmla
