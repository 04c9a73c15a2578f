// Packed low-bit MLA decode attention for Hopper (sm_90a) with many query heads: 64 heads per CTA on M of every
// warpgroup product, each page dequantized ONCE per CTA into shared memory (the "wgmma64" kernel).
//
// Why: the swap-AB kernel (decode_mla_sm90.cu) and the mma kernel (decode_mla.cu) unpack every page in registers
// once per 16-head CTA, so at 64 / 128 heads (DeepSeek-V3 at TP2 / data-parallel attention) a page is unpacked 4-8
// times and the products run as 16-row tiles: 0.26-0.63x FlashMLA BF16 on the H200. Here the unpacking is paid once
// per 64 heads and the products are the full-height tiles FlashMLA runs, on 2-6x fewer bytes. (A first version
// dequantized to fp16 values c s + o: its LSE drifted by up to 0.12 at large values, and one outstanding load per
// thread left it latency-bound; results/gpu_tests_h200_2026-12-01_wgmma64_v1.log.)
//
// Same contract, launch grid (x = ceil(H / 64) head groups), page layout (quantmla.kernels.layout) and partial
// outputs as the other two kernels, so the host side, the BF16 sink/local kernel and the combine are shared. The
// torch reference of the same byte layout is the definition: quantmla/kernels/reference.py.
//
// One CTA = two warpgroups = one (64-head group, split, sequence); tiles of 32 tokens (half a page). Warpgroup w
// owns half of the channels for both products ("split-D"): content channels 256w .. 256w + 255 (groups a = 2w and
// b = 2w + 1) and RoPE channels 32w .. 32w + 31. Per tile, each warpgroup:
//   (1) (issued two tiles ahead) copies its bytes of the packed tile with cp.async into a thread-private staging
//       (lane = token, warp = quarter of the warpgroup's channels; the block-table entry is read a tile earlier);
//   (2) unpacks them into shared memory as EXACT bf16 codes (magic-number LOP3, minus the magic: every code of
//       every format is a bf16 integer), and the token's scales and offsets as floats; out-of-range tokens are
//       stored as zeros (their bytes and meta may be anything, NaN included). Each 8-channel chunk holds its
//       channels in the order (0 2 1 3 4 6 5 7) (what the LOP3 pairs give); q is staged in the same order and the
//       epilogue maps the output columns back. BF16 pages: the values themselves, loaded one tile ahead;
//   (3) score partials per scale: acc_k[64 heads x 32 tokens] = q_k codes_k^T for k = group a, group b, its RoPE
//       half (18 wgmma.m64n32k16, both operands K-major in shared memory; q = bf16(q * qk_scale), staged once), then
//       S_w = sum_k s_k[t] acc_k + o_k[t] qsum_k[h] (per-token scales are column scales: never per element);
//   (4) exchanges S_w with the other warpgroup through shared memory (S = S_0 + S_1, the same bits in both),
//       masks, and runs the online softmax (lazy running maximum, as decode_mla.cu) on its own copy;
//   (5) O_k[64 x 128] += bf16(P s_k) codes_k for its two groups (4 wgmma.m64n128k16: P s_k in registers as the A
//       fragment, the tile read MN-major as B), and sum_t P o_k per row for the offsets (added in the epilogue);
//       step (2) of the next tile runs while these products do.
// Shared memory: q 72 KB, 2 stages x 2 warpgroups x 18 KB of tile, 32 KB of score exchange, the staging (20-45
// KB): one CTA per SM. Writes each split's normalized partial output and log2-sum-exp in the others' layout.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_launch.cuh"
#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_wgmma.cuh"
#include "mla_h64_tile.cuh"
#include "mla_wgmma_h64.cuh"

namespace qmla {
namespace h64 {

// q of the CTA's 64 heads as bf16(q * qk_scale) (the reference's rounding) in the chunk layout and slot order of
// the tiles, and (packed pages) its sums over each content group and each RoPE half (for the offset terms). Uses
// the tile stages and the score exchange as scratch; ends with a CTA barrier.
template <bool kBf16>
__device__ __forceinline__ void stage_q64(uint8_t* smem, const Params& p, int b, int h0) {
  constexpr int kRow = kDc + kDr;
  __nv_bfloat162* raw = reinterpret_cast<__nv_bfloat162*>(smem + ST_SM);  // [head][576]
  float* part = reinterpret_cast<float*>(smem + X_SM);                    // [chunk 72][head 64]
  const int tid = threadIdx.x;
#pragma unroll 4
  for (int f = tid; f < kHeads * kRow / 2; f += kThreads) {
    raw[f] = scaled_q_pair(p, b, h0 + f / (kRow / 2), 2 * (f % (kRow / 2)));
  }
  __syncthreads();
  const uint16_t* rawh = reinterpret_cast<const uint16_t*>(raw);
  for (int f = tid; f < kHeads * (kRow / 8); f += kThreads) {  // (head, chunk): consecutive threads, heads
    const int hh = f % kHeads, chunk = f / kHeads;
    uint16_t v[8];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = rawh[hh * kRow + 8 * chunk + slot_channel<!kBf16>(j)];
      sum += __uint_as_float((uint32_t)v[j] << 16);
    }
    part[chunk * kHeads + hh] = sum;
    uint4 w;
    w.x = v[0] | (uint32_t)v[1] << 16, w.y = v[2] | (uint32_t)v[3] << 16;
    w.z = v[4] | (uint32_t)v[5] << 16, w.w = v[6] | (uint32_t)v[7] << 16;
    *reinterpret_cast<uint4*>(smem + Q_SM + chunk * kQChunk + hh * 16) = w;
  }
  __syncthreads();
  float* qs = reinterpret_cast<float*>(smem + QS_SM);
  for (int f = tid; f < 6 * kHeads; f += kThreads) {  // slot u: content groups 0-3 (16 chunks), RoPE halves (4)
    const int u = f / kHeads, hh = f % kHeads, c0 = u < 4 ? 16 * u : 64 + 4 * (u - 4), nc = u < 4 ? 16 : 4;
    float sum = 0.f;
    for (int c = 0; c < nc; ++c) sum += part[(c0 + c) * kHeads + hh];
    qs[u * kHeads + hh] = sum;
  }
  __syncthreads();
}

// Descriptors as base + byte offset (Desc::at: the low half only, so ptxas keeps one base per operand and adds
// immediates instead of rebuilding every descriptor)
__device__ __forceinline__ void score_product(float (&d)[16], const Desc& q, uint32_t q_at, const Desc& t,
                                              uint32_t t_at, int accumulate) {
  wgmma_ss_bf16_n32(d, q.at(q_at), q.hi, t.at(t_at), t.hi, accumulate);
}
__device__ __forceinline__ void output_product(float* d, const uint32_t (&a)[4], const Desc& v, uint32_t v_at) {
  wgmma_rs_bf16_n128_t(*reinterpret_cast<float(*)[64]>(d), a, v.at(v_at), v.hi);
}

template <int CB, int RB, bool CSYM, bool RSYM>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel_h64(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  constexpr bool kBf16 = CB == 16;
  static_assert(kBf16 ? RB == 16 : ((CB == 2 || CB == 4 || CB == 8) && (RB == 4 || RB == 8)), "bits");
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_launch_dependents();  // the split merge may launch now (QMLA_PDL; it waits for this grid to finish)
  const int hg = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int h0 = hg * kHeads;
  const int n = p.lens[b];
  const int lo = p.sink, hi = max(n - p.local, p.sink);
  const int pg0 = lo / kPage + sp * p.pps;
  const int pg1 = min(pg0 + p.pps, (hi + kPage - 1) / kPage);
  const int T0 = max(2 * pg0, lo / kTile), T1 = min(2 * pg1, (hi + kTile - 1) / kTile);  // tiles of this split
  const int* bt = p.block_table + (long long)b * p.bt_stride;

  stage_q64<kBf16>(smem, p, b, h0);
  const float* qsm = reinterpret_cast<const float*>(smem + QS_SM);  // q sums [slot][head], read where used

  auto tile_ok = [&](int T) { const int tok = T * kTile + lane; return tok >= lo && tok < hi; };
  auto half_at = [&](int st) { return smem + ST_SM + (st * 2 + wg) * kHalf; };
  auto meta_at = [&](int st) { return reinterpret_cast<float*>(smem + MT_SM) + ((st * 2 + wg) * kTile) * 8; };
  auto page_of = [&](int T) { return T < T1 ? bt[T >> 1] : 0; };
  auto page_ptr = [&](int page) { return p.pool + (long long)page * p.page_bytes; };
  // Packed pages: tile T + 2 is copied (cp.async into a thread-private staging) while tile T runs; BF16 pages
  // (4x the bytes, through registers): tile T + 1. The block-table entry of the next tile to load is read a tile
  // before its loads are issued, so they never wait for it.
  constexpr int kAhead = kBf16 ? 1 : 2;
  int page_next = 0;
  Bf16Tile bf;  // (BF16 pages only)
  auto stg_at = [&](int T) {  // byte offset of tile T's staging (packed pages)
    return STG_SM + (((T - T0) & 1) * 2 + wg) * Staging<kBf16 ? 2 : CB>::BYTES;
  };
  auto fetch = [&](int T, int page) {  // start loading tile T (T < T1)
    if constexpr (kBf16) bf.load(page_ptr(page), p, (T & 1) * kTile + lane, wg, warp);
    else PackedTile<CB, RB, CSYM, RSYM>::issue(smem_u32(smem) + stg_at(T), page_ptr(page), p, (T & 1) * kTile + lane,
                                              wg, warp, lane);
  };
  auto put = [&](int T, int st) {  // tile T (loaded) into tile stage st
    if constexpr (kBf16) {
      bf.store(half_at(st), lane, warp, tile_ok(T));
    } else {
      cp_async_wait<1>();  // tile T's group (the newest, T + 1's, may still be in flight)
      PackedTile<CB, RB, CSYM, RSYM>::store(smem + stg_at(T), half_at(st), meta_at(st) + 8 * lane, lane, wg, warp,
                                            tile_ok(T));
    }
  };
  if (T0 < T1) {
    fetch(T0, page_of(T0));
    if constexpr (!kBf16) {
      cp_async_commit();
      if (T0 + 1 < T1) fetch(T0 + 1, page_of(T0 + 1));
      cp_async_commit();
    }
    put(T0, 0);
    page_next = page_of(T0 + kAhead);
  }

  float o[128];  // O of the warpgroup's 256 channels: group a (o[0..63]), group b (o[64..127])
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, r_off[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  const uint32_t q_u = smem_u32(smem + Q_SM);
  const Desc q_content(wgmma_desc(q_u + 16 * wg * 2 * kQChunk, kQChunk, 128));  // this warpgroup's q k-blocks
  const Desc q_rope(wgmma_desc(q_u + (32 + 2 * wg) * 2 * kQChunk, kQChunk, 128));

  for (int T = T0; T < T1; ++T) {
    const int it = T - T0, st = it & 1;
    if (T + kAhead < T1) fetch(T + kAhead, page_next);  // in flight during this tile (and the next)
    if constexpr (!kBf16) cp_async_commit();            // one group per tile, empty ones included
    page_next = page_of(T + kAhead + 1);
    fence_proxy_async();
    named_bar(2 + wg, 128);  // this warpgroup's half of tile T is in shared memory
    const uint32_t half_u = smem_u32(half_at(st));
    const Desc tdesc(wgmma_desc(half_u, kTChunk, 128)), vdesc(wgmma_desc(half_u, 128, kTChunk));  // K-, MN-major

    // ---- partial scores over this warpgroup's content groups a, b and its RoPE half: codes . q
    constexpr int kAcc = kBf16 ? 1 : 3;  // packed: groups a, b and RoPE apart (their scales differ per token)
    float acc[kAcc][16];  // the first product of each accumulator does not read it
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 18; ++j)  // q's k-blocks: 16 wg + j (content), 32 + 2 wg + j - 16 (RoPE)
      score_product(acc[kBf16 ? 0 : j < 8 ? 0 : j < 16 ? 1 : 2], j < 16 ? q_content : q_rope,
                    (j < 16 ? j : j - 16) * 2 * kQChunk, tdesc, j * 2 * kTChunk,
                    kBf16 ? j > 0 : j != 0 && j != 8 && j != 16);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < kAcc; ++k) fence_operands(acc[k]);
    fence_operands(o);

    // ---- scales on the accumulators: S_w = sum_k s_k[t] acc_k + o_k[t] qs_k (BF16 pages: the plain sum)
    const float* mrow = meta_at(st);
    float s[16];
    float qs[3][2];  // q sums of this thread's rows over groups a, b and the warpgroup's RoPE half
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = 16 * warp + g + 8 * v1;
      qs[0][v1] = kBf16 ? 0.f : qsm[(2 * wg) * kHeads + r];
      qs[1][v1] = kBf16 ? 0.f : qsm[(2 * wg + 1) * kHeads + r];
      qs[2][v1] = kBf16 ? 0.f : qsm[(4 + wg) * kHeads + r];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int v0 = 0; v0 < 2; ++v0) {
        const int col = 8 * j + 2 * t + v0;
        if constexpr (kBf16) {
#pragma unroll
          for (int v1 = 0; v1 < 2; ++v1) {
            const int i = 4 * j + v0 + 2 * v1;
            s[i] = acc[0][i];
          }
        } else {
          const float4 sc = *reinterpret_cast<const float4*>(mrow + 8 * col);
          const float4 of = *reinterpret_cast<const float4*>(mrow + 8 * col + 4);
#pragma unroll
          for (int v1 = 0; v1 < 2; ++v1) {
            const int i = 4 * j + v0 + 2 * v1;
            float x = fmaf(of.x, qs[0][v1], fmaf(of.y, qs[1][v1], of.z * qs[2][v1]));
            x = fmaf(sc.x, acc[0][i], x);
            x = fmaf(sc.y, acc[1][i], x);
            s[i] = fmaf(sc.z, acc[2][i], x);
          }
        }
      }

    // ---- S = S_0 + S_1 (the same bits in both warpgroups), mask, online softmax
    float4* xw = reinterpret_cast<float4*>(smem + X_SM) + (((it & 1) * 2 + wg) * 4) * 128 + wt;
#pragma unroll
    for (int j = 0; j < 4; ++j) xw[j * 128] = make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
    named_bar(1, kThreads);
    const float4* xr = reinterpret_cast<const float4*>(smem + X_SM) + (((it & 1) * 2 + (wg ^ 1)) * 4) * 128 + wt;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 x = xr[j * 128];
      s[4 * j] += x.x, s[4 * j + 1] += x.y, s[4 * j + 2] += x.z, s[4 * j + 3] += x.w;
    }
    const int tok0 = T * kTile;
    const bool edge = tok0 < lo || tok0 + kTile > hi;
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int v0 = 0; v0 < 2; ++v0) {
        const int tok = tok0 + 8 * j + 2 * t + v0;
        const bool ok = !edge || (tok >= lo && tok < hi);
#pragma unroll
        for (int v1 = 0; v1 < 2; ++v1) {
          float& x = s[4 * j + v0 + 2 * v1];
          x = ok ? x : -INFINITY;
          mt[v1] = fmaxf(mt[v1], x);
        }
      }
    bool need[2], any = false;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      mt[v1] = fmaxf(mt[v1], __shfl_xor_sync(0xffffffffu, mt[v1], 1));
      mt[v1] = fmaxf(mt[v1], __shfl_xor_sync(0xffffffffu, mt[v1], 2));
      need[v1] = mt[v1] > m_run[v1] + kLazy;  // false for an empty tile (-inf)
      any |= need[v1];
    }
    if (__any_sync(0xffffffffu, any)) {
      float alpha[2];
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const float m_new = need[v1] ? mt[v1] : m_run[v1];
        alpha[v1] = need[v1] ? ex2(m_run[v1] - m_new) : 1.f;  // 0 from -inf
        m_run[v1] = m_new;
        l_run[v1] *= alpha[v1];
        r_off[0][v1] *= alpha[v1];
        r_off[1][v1] *= alpha[v1];
      }
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
    uint32_t a[2][2][4];  // [group a / b][k-step]: bf16(P s_g) as the A fragments (BF16 pages: P)
    {
      float pr[16];
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const float ms = m_run[v1] == -INFINITY ? 0.f : m_run[v1];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int v0 = 0; v0 < 2; ++v0) {
            const int i = 4 * j + v0 + 2 * v1;
            pr[i] = ex2(s[i] - ms);
            l_run[v1] += pr[i];
            if constexpr (!kBf16) {  // the offset terms sum_t P o_g (meta re-read: fewer live registers)
              const float2 of = *reinterpret_cast<const float2*>(mrow + 8 * (8 * j + 2 * t + v0) + 4);
              r_off[0][v1] = fmaf(pr[i], of.x, r_off[0][v1]);
              r_off[1][v1] = fmaf(pr[i], of.y, r_off[1][v1]);
            }
          }
      }
#pragma unroll
      for (int gi = 0; gi < 2; ++gi)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = 4 * (2 * ks + (r >> 1)) + 2 * (r & 1);  // a0: (g, k 2t), a1: (g+8, 2t), a2: (g, 2t+8), ..
            const int col = 8 * (2 * ks + (r >> 1)) + 2 * t;     // its two tokens: col, col + 1
            a[gi][ks][r] = kBf16 ? pack_bf16(pr[i], pr[i + 1])
                                 : pack_bf16(pr[i] * mrow[8 * col + gi], pr[i + 1] * mrow[8 * col + 8 + gi]);
          }
    }

    // ---- O_g += bf16(P s_g) codes_g over the tile's two 16-token k-steps, asynchronous
    fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int gi = 0; gi < 2; ++gi)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
        output_product(o + 64 * gi, a[gi][ks], vdesc, 16 * gi * kTChunk + ks * 256);
    wgmma_commit();
    if (T + 1 < T1) put(T + 1, st ^ 1);  // the next tile into the other stage meanwhile
#pragma unroll
    for (int gi = 0; gi < 2; ++gi)  // the P registers stay untouched until the products have read them
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
        asm volatile("" ::"r"(a[gi][ks][0]), "r"(a[gi][ks][1]), "r"(a[gi][ks][2]), "r"(a[gi][ks][3]));
    wgmma_wait<0>();  // before the next tile's score accumulators (ptxas serializes every wgmma otherwise: C7515)
  }
  wgmma_wait<0>();
  fence_operands(o);

  // ---- epilogue: row sums and offset terms over the four lanes of a row; normalized partial output, log2-sum-exp
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    float l = l_run[v1], ra0 = r_off[0][v1], ra1 = r_off[1][v1];
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      l += __shfl_xor_sync(0xffffffffu, l, x);
      ra0 += __shfl_xor_sync(0xffffffffu, ra0, x);
      ra1 += __shfl_xor_sync(0xffffffffu, ra1, x);
    }
    const int h = h0 + 16 * warp + g + 8 * v1;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (wg == 0 && t == 0 && h < p.H) p.pl[row0 + h] = l > 0.f ? m_run[v1] + log2f(l) : -INFINITY;
    if (h < p.H) {
      float* out = p.po + (row0 + h) * kDc + 256 * wg;
#pragma unroll
      for (int j = 0; j < 32; ++j)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0)
          out[8 * j + slot_channel<!kBf16>(2 * t + v0)] = (o[4 * j + v0 + 2 * v1] + (j < 16 ? ra0 : ra1)) * inv;
    }
  }
#endif
}

// The kernel family for mla_launch.cuh.
struct H64Kernel {
  static constexpr int kThreads = h64::kThreads;
  template <int CB, int RB>
  static constexpr bool has =
      (RB == 4 && (CB == 2 || CB == 4)) || (RB == 8 && (CB == 4 || CB == 8)) || (CB == 16 && RB == 16);
  static int heads_per_cta(int, int) { return kHeads; }
  static int head_ctas(int H, int) { return (H + kHeads - 1) / kHeads; }
  template <int CB, int RB>
  static int smem(int) { return smem_bytes<CB>(); }
  template <int CB, int RB, bool CSYM, bool RSYM>
  static KernelFn fn(int) { return decode_kernel_h64<CB, RB, CSYM, RSYM>; }
};

}  // namespace h64
}  // namespace qmla

// The same C entry points as decode_mla.cu (a separate library); grid (ceil(H / 64), splits, B).
QMLA_EXPORT_DECODE(qmla::h64::H64Kernel)
