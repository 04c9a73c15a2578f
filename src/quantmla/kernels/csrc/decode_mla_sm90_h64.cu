// Packed low-bit MLA decode attention for Hopper (sm_90a) with many query heads: 64 heads per CTA on M of every
// warpgroup product, each page dequantized ONCE per CTA into shared memory (the "wgmma64" kernel).
//
// Why: the swap-AB kernel (decode_mla_sm90.cu) and the mma kernel (decode_mla.cu) unpack every page in registers
// once per 16-head CTA, so at 64 / 128 heads (DeepSeek-V3 at TP2 / data-parallel attention) a page is unpacked 4-8
// times and the products run as 16-row tiles: 0.26-0.63x FlashMLA BF16 on the H200. Here the unpacking is paid once
// per 64 heads and the products are the full-height tiles FlashMLA runs, on 4-16x fewer bytes.
//
// Same contract, launch grid (x = ceil(H / 64) head groups), page layout (quantmla.kernels.layout) and partial
// outputs as the other two kernels, so the host side, the BF16 sink/local kernel and the combine are shared. The
// torch reference of the same byte layout is the definition: quantmla/kernels/reference.py.
//
// One CTA = two warpgroups = one (64-head group, split, sequence); tiles of 32 tokens (half a page). Warpgroup w
// owns half of the channels for both products ("split-D"): content channels 256w .. 256w + 255 (groups 2w, 2w + 1)
// and RoPE channels 32w .. 32w + 31. Per tile, each warpgroup:
//   (1) (issued a tile ahead) loads its half of the packed tile with plain global loads into registers, one token
//       per lane, one quarter of the half per warp;
//   (2) dequantizes it into shared memory as fp16 (BF16 pages: copies bf16): the codes become exact fp16 numbers by
//       the magic-number LOP3 (1024 + c, minus 1024), then v = c s + o in one fp16x2 FMA (one rounding of the exact
//       value, as the fp32 reference rounded to fp16); out-of-range tokens are stored as zeros (their bytes and
//       meta may be anything, NaN included). Each 8-channel chunk holds its channels in the order (0 2 1 3 4 6 5 7)
//       (what the LOP3 pairs give); q is staged in the same order and the epilogue maps the output columns back;
//   (3) score partial S_w[64 heads x 32 tokens] = q_w k_w^T over its 288 channels: 18 wgmma.m64n32k16, A = q
//       (fp16, staged once per CTA, times 2^-e as in the other kernels) and B = the tile, both K-major in shared
//       memory;
//   (4) exchanges the partial with the other warpgroup through shared memory (S = S_0 + S_1, the same bits in both),
//       masks, and runs the online softmax (lazy running maximum, as decode_mla.cu) on its own copy;
//   (5) output O_w[64 x 256] += P V_w: 2 wgmma.m64n256k16 with P (fp16, <= 2^8) in registers as the A fragment
//       and the same tile read MN-major as B; asynchronous: step (2) of the next tile runs meanwhile.
// Shared memory: q 72 KB, 2 stages x 2 warpgroups x 18 KB of tile, 32 KB of score exchange: one CTA per SM.
// Writes each split's normalized partial output and its log2-sum-exp (warpgroup 0) in the layout of the others.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_launch.cuh"
#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_wgmma.cuh"
#include "mla_wgmma_h64.cuh"

namespace qmla {
namespace h64 {

constexpr int kThreads = 256;                 // two warpgroups
constexpr int kHeads = 64;                    // heads per CTA: M of every product
constexpr int kTile = 32;                     // tokens per tile
constexpr int kQChunk = kHeads * 16;          // bytes of one 8-channel chunk of q (64 rows of 16 bytes)
constexpr int kTChunk = kTile * 16;           // bytes of one 8-channel chunk of a tile
constexpr int kHalf = 36 * kTChunk;           // one warpgroup's half of a tile: 32 content + 4 RoPE chunks
constexpr int Q_SM = 0;                       // q [chunk 72][head 64][8 channels]
constexpr int ST_SM = Q_SM + 72 * kQChunk;    // tiles [stage 2][warpgroup 2][chunk 36][token 32][8 channels]
constexpr int X_SM = ST_SM + 4 * kHalf;       // partial scores [parity 2][warpgroup 2][4][128 threads] float4
constexpr int R_SM = X_SM + 2 * 2 * 4 * 128 * 16;  // [8 warps] floats
constexpr int SMEM = R_SM + 8 * 4;
static_assert(4 * kHalf == kHeads * (kDc + kDr) * 2, "the raw bf16 q is staged over the tile stages");

// channel (within its 8-channel chunk) held by slot j: the LOP3 pairs give (c0, c2), (c1, c3) per 32-bit word
template <bool PERM>
__device__ __forceinline__ int slot_channel(int j) {
  return PERM ? (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1) : j;
}

__device__ __forceinline__ void named_bar(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n)); }

__device__ __forceinline__ uint32_t h2u(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 u2h(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }

// 8 codes of plane `pl` of 8 consecutive bytes (u0, u1) -> 8 fp16 values c s + o in slot order
template <int B>
__device__ __forceinline__ uint4 dequant8(uint32_t u0, uint32_t u1, int pl, __half2 s2, __half2 o2) {
  constexpr uint32_t mask = ((1u << B) - 1u) * 0x00010001u;
  const uint32_t x0 = u0 >> (B * pl), x1 = u1 >> (B * pl);
  const __half2 k1024 = u2h(kMagicF16);
  const uint32_t m[4] = {and_or(x0, mask, kMagicF16), and_or(x0 >> 8, mask, kMagicF16), and_or(x1, mask, kMagicF16),
                         and_or(x1 >> 8, mask, kMagicF16)};
  uint32_t v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = h2u(__hfma2(__hsub2(u2h(m[i]), k1024), s2, o2));
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// One thread's share of a tile half: lane = token, warp (of the warpgroup) = quarter of the warpgroup's channels.
template <int CB, int RB, bool CSYM, bool RSYM>
struct TileRegs {
  static constexpr bool kBf16 = CB == 16;
  static constexpr int CW = kBf16 ? 32 : 2 * CB;  // 32-bit words of content: 64 bf16 channels, or 8 CB bytes
  static constexpr int RW = kBf16 ? 4 : 2;        // RoPE: 8 bf16 channels, or 8 bytes
  static constexpr int CBYTES = kBf16 ? 2 * kDc : kDc * CB / 8, RBYTES = kBf16 ? 2 * kDr : kDr * RB / 8;
  static constexpr int GB = 16 * CB;              // packed bytes of one content group
  uint32_t c[CW], r[RW];
  __half cs, co, rs, ro;

  __device__ __forceinline__ void load(const uint8_t* page, const Params& p, int tau, int wg, int q) {
    if constexpr (kBf16) {
      const uint4* src = reinterpret_cast<const uint4*>(page + p.c_off + tau * CBYTES + (256 * wg + 64 * q) * 2);
#pragma unroll
      for (int k = 0; k < CW / 4; ++k) {
        const uint4 v = __ldg(src + k);
        c[4 * k] = v.x, c[4 * k + 1] = v.y, c[4 * k + 2] = v.z, c[4 * k + 3] = v.w;
      }
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(page + p.r_off + tau * RBYTES + (32 * wg + 8 * q) * 2));
      r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else {
      using M = MetaRows<CSYM, RSYM>;
      const int gr = 2 * wg + (q >> 1);
      const uint4* src = reinterpret_cast<const uint4*>(page + p.c_off + tau * CBYTES + gr * GB + (q & 1) * (GB / 2));
#pragma unroll
      for (int k = 0; k < CW / 4; ++k) {
        const uint4 v = __ldg(src + k);
        c[4 * k] = v.x, c[4 * k + 1] = v.y, c[4 * k + 2] = v.z, c[4 * k + 3] = v.w;
      }
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(page + p.r_off + tau * RBYTES + (RB == 4 ? 8 * q : 32 * wg + 8 * q)));
      r[0] = v.x, r[1] = v.y;
      const __half* meta = reinterpret_cast<const __half*>(page + p.m_off);
      cs = meta[(M::CS + gr) * kPage + tau];
      rs = meta[M::RS * kPage + tau];
      if constexpr (!CSYM) co = meta[(M::CO + gr) * kPage + tau];
      if constexpr (!RSYM) ro = meta[M::RO * kPage + tau];
    }
  }

  // into a warpgroup's tile half (token n = lane, quarter q = warp); zeros when the token is out of range
  __device__ __forceinline__ void store(uint8_t* half, int n, int wg, int q, bool ok) const {
    uint8_t* row = half + (n >> 3) * 128 + (n & 7) * 16;
    auto put = [&](int chunk, uint4 v) { *reinterpret_cast<uint4*>(row + chunk * kTChunk) = v; };
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    if constexpr (kBf16) {
#pragma unroll
      for (int k = 0; k < 8; ++k) put(8 * q + k, ok ? make_uint4(c[4 * k], c[4 * k + 1], c[4 * k + 2], c[4 * k + 3]) : z);
      put(32 + q, ok ? make_uint4(r[0], r[1], r[2], r[3]) : z);
    } else {
      constexpr int F = 8 / CB;
      const __half2 s2 = __half2half2(cs), rs2 = __half2half2(rs);
      const __half2 o2 = CSYM ? __hmul2(s2, __float2half2_rn(-(float)(1 << (CB - 1)))) : __half2half2(co);
      const __half2 ro2 = RSYM ? __hmul2(rs2, __float2half2_rn(-(float)(1 << (RB - 1)))) : __half2half2(ro);
      const int base = (q >> 1) * 16 + (q & 1) * CB;  // chunk of plane 0's first 8 bytes
#pragma unroll
      for (int pl = 0; pl < F; ++pl)
#pragma unroll
        for (int k = 0; k < CB; ++k)
          put(base + pl * 2 * CB + k, ok ? dequant8<CB>(c[2 * k], c[2 * k + 1], pl, s2, o2) : z);
      put(32 + q, ok ? dequant8<RB>(r[0], r[1], RB == 4 ? wg : 0, rs2, ro2) : z);
    }
  }
};

// q of the CTA's 64 heads: bf16(q * qk_scale) (the reference's rounding), then (packed pages) times 2^-e as fp16,
// in the chunk layout and slot order of the tiles. Uses the tile stages as scratch; ends with a CTA barrier.
template <bool kBf16>
__device__ __forceinline__ int stage_q64(uint8_t* smem, const Params& p, int b, int h0) {
  constexpr int kRow = kDc + kDr;
  __nv_bfloat162* raw = reinterpret_cast<__nv_bfloat162*>(smem + ST_SM);  // [head][576]
  float* scratch = reinterpret_cast<float*>(smem + R_SM);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float amax = 0.f;
#pragma unroll 4
  for (int f = tid; f < kHeads * kRow / 2; f += kThreads) {
    const int hh = f / (kRow / 2), ch = 2 * (f % (kRow / 2)), h = h0 + hh;
    float x0 = 0.f, x1 = 0.f;
    if (h < p.H) {
      const void* q = ch < kDc ? p.q_lat : p.q_pe;
      const long long i = ch < kDc ? (long long)b * p.q_lat_sb + (long long)h * p.q_lat_sh + ch
                                   : (long long)b * p.q_pe_sb + (long long)h * p.q_pe_sh + (ch - kDc);
      x0 = load_q(q, i, p.q_fp32) * p.qk_scale;
      x1 = load_q(q, i + 1, p.q_fp32) * p.qk_scale;
    }
    const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
    amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
    raw[f] = v;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) scratch[warp] = amax;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) m = fmaxf(m, scratch[i]);
  const int E = m > 0.f ? ((__float_as_int(m) >> 23) & 0xff) - 127 : 14;
  const int e = kBf16 ? 0 : min(max(E - 14, -100), 100);
  const float down = exp2i(-e);
  const __nv_bfloat16* rawh = reinterpret_cast<const __nv_bfloat16*>(raw);
  for (int f = tid; f < kHeads * (kRow / 8); f += kThreads) {  // (head, chunk): consecutive threads, heads
    const int hh = f % kHeads, chunk = f / kHeads;
    uint16_t v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const __nv_bfloat16 x = rawh[hh * kRow + 8 * chunk + slot_channel<!kBf16>(j)];
      if constexpr (kBf16) v[j] = *reinterpret_cast<const uint16_t*>(&x);
      else {
        const __half y = __float2half_rn(__bfloat162float(x) * down);  // exact: bf16 in fp16's range
        v[j] = *reinterpret_cast<const uint16_t*>(&y);
      }
    }
    uint4 w;
    w.x = v[0] | (uint32_t)v[1] << 16, w.y = v[2] | (uint32_t)v[3] << 16;
    w.z = v[4] | (uint32_t)v[5] << 16, w.w = v[6] | (uint32_t)v[7] << 16;
    *reinterpret_cast<uint4*>(smem + Q_SM + chunk * kQChunk + hh * 16) = w;
  }
  __syncthreads();
  return e;
}

template <bool kBf16>
__device__ __forceinline__ void score_product(float (&d)[16], uint64_t qd, uint64_t td) {
  if constexpr (kBf16) wgmma_ss_bf16_n32(d, (uint32_t)qd, (uint32_t)(qd >> 32), (uint32_t)td, (uint32_t)(td >> 32));
  else wgmma_ss_f16_n32(d, (uint32_t)qd, (uint32_t)(qd >> 32), (uint32_t)td, (uint32_t)(td >> 32));
}
template <bool kBf16>
__device__ __forceinline__ void output_product(float (&d)[128], const uint32_t (&a)[4], uint64_t vd) {
  if constexpr (kBf16) wgmma_rs_bf16_n256_t(d, a, (uint32_t)vd, (uint32_t)(vd >> 32));
  else wgmma_rs_f16_n256_t(d, a, (uint32_t)vd, (uint32_t)(vd >> 32));
}

template <int CB, int RB, bool CSYM, bool RSYM>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel_h64(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  constexpr bool kBf16 = CB == 16;
  static_assert(kBf16 ? RB == 16 : ((CB == 2 || CB == 4 || CB == 8) && (RB == 4 || RB == 8)), "bits");
  extern __shared__ __align__(128) uint8_t smem[];
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

  const int e = stage_q64<kBf16>(smem, p, b, h0);
  const float two_e = exp2i(e);

  TileRegs<CB, RB, CSYM, RSYM> regs;
  auto tile_ok = [&](int T) { const int tok = T * kTile + lane; return tok >= lo && tok < hi; };
  auto load = [&](int T) {
    regs.load(p.pool + (long long)bt[T >> 1] * p.page_bytes, p, (T & 1) * kTile + lane, wg, warp);
  };
  auto half_at = [&](int st) { return smem + ST_SM + (st * 2 + wg) * kHalf; };
  if (T0 < T1) {
    load(T0);
    regs.store(half_at(0), lane, wg, warp, tile_ok(T0));
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const uint32_t q_u = smem_u32(smem + Q_SM);

  for (int T = T0; T < T1; ++T) {
    const int it = T - T0, st = it & 1;
    const bool more = T + 1 < T1;
    if (more) load(T + 1);  // in flight during this tile's products
    fence_proxy_async();
    named_bar(2 + wg, 128);  // this warpgroup's half of tile T is in shared memory
    const uint32_t half_u = smem_u32(half_at(st));

    // ---- (3) partial scores over this warpgroup's 16 content + 2 RoPE k-blocks
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    fence_operands(s);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 18; ++j) {
      const int kq = j < 16 ? 16 * wg + j : 32 + 2 * wg + (j - 16);  // k-block of q (16 channels)
      score_product<kBf16>(s, wgmma_desc(q_u + kq * 2 * kQChunk, kQChunk, 128),
                           wgmma_desc(half_u + j * 2 * kTChunk, kTChunk, 128));
    }
    wgmma_commit();
    wgmma_wait<0>();  // also the previous tile's output product: O and the other stage are free
    fence_operands(s);
    fence_operands(o);

    // ---- (4) S = S_0 + S_1 (the same bits in both warpgroups), mask, online softmax
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
          x = ok ? x * two_e : -INFINITY;
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
      }
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
    uint32_t a[2][4];  // P as the A fragments of the two 16-token k-steps
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
          }
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 4 * (2 * ks + (r >> 1)) + 2 * (r & 1);  // a0: (g, k 2t), a1: (g+8, 2t), a2: (g, 2t+8), ...
          a[ks][r] = kBf16 ? pack_bf16(pr[i], pr[i + 1]) : pack_f16(pr[i], pr[i + 1]);
        }
    }

    // ---- (5) O += P V over the tile's two 16-token k-steps, asynchronous
    fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) output_product<kBf16>(o, a[ks], wgmma_desc(half_u + ks * 256, 128, kTChunk));
    wgmma_commit();
    if (more) regs.store(half_at(st ^ 1), lane, wg, warp, tile_ok(T + 1));  // (2) of the next tile meanwhile
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)  // the P registers stay untouched until the products have read them
      asm volatile("" ::"r"(a[ks][0]), "r"(a[ks][1]), "r"(a[ks][2]), "r"(a[ks][3]));
  }
  wgmma_wait<0>();
  fence_operands(o);

  // ---- epilogue: row sums over the four lanes of a row; normalized partial output, log2-sum-exp
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    float l = l_run[v1];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int h = h0 + 16 * warp + g + 8 * v1;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (wg == 0 && t == 0 && h < p.H) p.pl[row0 + h] = l > 0.f ? m_run[v1] + log2f(l) : -INFINITY;
    if (h < p.H) {
      float* out = p.po + (row0 + h) * kDc + 256 * wg;
#pragma unroll
      for (int j = 0; j < 32; ++j)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) out[8 * j + slot_channel<!kBf16>(2 * t + v0)] = o[4 * j + v0 + 2 * v1] * inv;
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
  static int smem(int) { return SMEM; }
  template <int CB, int RB, bool CSYM, bool RSYM>
  static KernelFn fn(int) { return decode_kernel_h64<CB, RB, CSYM, RSYM>; }
};

}  // namespace h64
}  // namespace qmla

// The same C entry points as decode_mla.cu (a separate library); grid (ceil(H / 64), splits, B).
QMLA_EXPORT_DECODE(qmla::h64::H64Kernel)
