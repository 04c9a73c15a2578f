// The tile side of the wgmma64 decode kernel (decode_mla_sm90_h64.cu): its shared-memory map, the conversion of
// packed codes into exact bf16 numbers, and one thread's share of a tile -- copied (cp.async, thread-private
// staging) and unpacked into the K-major / MN-major operand layout of the warpgroup products (mla_wgmma_h64.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"

namespace qmla {
namespace h64 {

constexpr int kThreads = 256;                 // two warpgroups
constexpr int kHeads = 64;                    // heads per CTA: M of every product
constexpr int kTile = 32;                     // tokens per tile
constexpr int kQChunk = kHeads * 16;          // bytes of one 8-channel chunk of q (64 rows of 16 bytes)
constexpr int kTChunk = kTile * 16;           // bytes of one 8-channel chunk of a tile
constexpr int kHalf = 36 * kTChunk;           // one warpgroup's half of a tile: 32 content + 4 RoPE chunks
constexpr int Q_SM = 0;                       // q [chunk 72][head 64][8 channels] bf16
constexpr int ST_SM = Q_SM + 72 * kQChunk;    // tiles [stage 2][warpgroup 2][chunk 36][token 32][8 channels] bf16
constexpr int X_SM = ST_SM + 4 * kHalf;       // partial scores [parity 2][warpgroup 2][4][128 threads] float4
constexpr int MT_SM = X_SM + 2 * 2 * 4 * 128 * 16;  // tile meta [stage 2][warpgroup 2][token 32][8] floats
constexpr int QS_SM = MT_SM + 2 * 2 * kTile * 8 * 4;  // q sums [6 (4 content groups, 2 RoPE halves)][head 64]
constexpr int STG_SM = QS_SM + 6 * kHeads * 4;  // packed pages: cp.async staging [tile parity 2][warpgroup 2]
static_assert(4 * kHalf == kHeads * (kDc + kDr) * 2, "the raw bf16 q is staged over the tile stages");
static_assert(72 * kHeads * 4 <= MT_SM - X_SM, "the q sums' partials are staged over the score exchange");

// channel (within its 8-channel chunk) held by slot j: the LOP3 pairs give (c0, c2), (c1, c3) per 32-bit word
template <bool PERM>
__device__ __forceinline__ int slot_channel(int j) {
  return PERM ? (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1) : j;
}

__device__ __forceinline__ void named_bar(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n)); }

// (128 + c_lo, 128 + c_hi) bf16 magic numbers minus 128: exact bf16 codes (c < 128)
__device__ __forceinline__ uint32_t bf16_codes(uint32_t m) {
  uint32_t y;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(y) : "r"(m), "r"(0x3F803F80u), "r"(0xC300C300u));
  return y;
}

// 8-bit fields as fp16 magic numbers (1024 + c) -> exact bf16 codes (c <= 255: 8 significant bits)
__device__ __forceinline__ uint32_t bf16_codes8(uint32_t m) {
  const __half2 c = __hsub2(*reinterpret_cast<const __half2*>(&m), __float2half2_rn(1024.f));
  return pack_bf16(__low2float(c), __high2float(c));
}

// The 8 B-bit codes of plane `pl` of 8 consecutive bytes (u0, u1) as exact bf16 numbers, in slot order
template <int B>
__device__ __forceinline__ uint4 codes8(uint32_t u0, uint32_t u1, int pl) {
  constexpr uint32_t mask = ((1u << B) - 1u) * 0x00010001u;
  const uint32_t x0 = u0 >> (B * pl), x1 = u1 >> (B * pl);
  const uint32_t f[4] = {x0, x0 >> 8, x1, x1 >> 8};
  uint32_t v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    v[i] = B == 8 ? bf16_codes8(and_or(f[i], mask, kMagicF16)) : bf16_codes(and_or(f[i], mask, kMagicBf16));
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// Where a thread's share of a packed tile is staged by cp.async (per warpgroup and stage, private to the thread:
// no barrier between its copy and its reads): content [16-byte chunk][quarter][lane], RoPE [quarter][lane] x 8 bytes,
// meta [row: content scale, content offset, RoPE scale, RoPE offset][quarter][lane] x 4 bytes (the aligned pair of
// tokens holding the thread's token).
template <int CB>
struct Staging {
  static constexpr int CK = CB / 2;                     // 16-byte content chunks per thread: 8 CB bytes
  static constexpr int C0 = 0, R0 = CK * 128 * 16, M0 = R0 + 128 * 8, BYTES = M0 + 4 * 128 * 4;
};

// One thread's share of a packed tile half: lane = token, warp (of the warpgroup) = quarter of its channels.
template <int CB, int RB, bool CSYM, bool RSYM>
struct PackedTile {
  using S = Staging<CB>;
  static constexpr int CBYTES = kDc * CB / 8, RBYTES = kDr * RB / 8;
  static constexpr int GB = 16 * CB;  // packed bytes of one content group

  // copy (cp.async, no registers) the thread's bytes of token tau of a page into its staging
  static __device__ __forceinline__ void issue(uint32_t stg, const uint8_t* page, const Params& p, int tau, int wg,
                                               int q, int lane) {
    using M = MetaRows<CSYM, RSYM>;
    const int gr = 2 * wg + (q >> 1), slot = q * 32 + lane;
    const uint8_t* src = page + p.c_off + tau * CBYTES + gr * GB + (q & 1) * (GB / 2);
#pragma unroll
    for (int k = 0; k < S::CK; ++k) cp_async16(stg + S::C0 + (k * 128 + slot) * 16, src + 16 * k);
    cp_async8(stg + S::R0 + slot * 8, page + p.r_off + tau * RBYTES + (RB == 4 ? 8 * q : 32 * wg + 8 * q));
    const uint8_t* meta = page + p.m_off + (tau & ~1) * 2;
    cp_async4(stg + S::M0 + (0 * 128 + slot) * 4, meta + (M::CS + gr) * kPage * 2);
    if constexpr (!CSYM) cp_async4(stg + S::M0 + (1 * 128 + slot) * 4, meta + (M::CO + gr) * kPage * 2);
    cp_async4(stg + S::M0 + (2 * 128 + slot) * 4, meta + M::RS * kPage * 2);
    if constexpr (!RSYM) cp_async4(stg + S::M0 + (3 * 128 + slot) * 4, meta + M::RO * kPage * 2);
  }

  // From the staging into a warpgroup's tile half (token n = lane, quarter q = warp) as exact bf16 codes, and the
  // token's scales and offsets into its meta row [s_a, s_b, s_r, -, o_a, o_b, o_r, -] (a, b: the warpgroup's two
  // content groups, r: RoPE; symmetric specs: o = -2^(bits-1) s). Zeros when the token is out of range: its bytes
  // and meta may be anything, NaN included.
  static __device__ __forceinline__ void store(const uint8_t* stg, uint8_t* half, float* meta_row, int n, int wg,
                                               int q, bool ok) {
    const int slot = q * 32 + n;
    uint8_t* row = half + (n >> 3) * 128 + (n & 7) * 16;
    auto put = [&](int chunk, uint4 v) { *reinterpret_cast<uint4*>(row + chunk * kTChunk) = v; };
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    constexpr int F = 8 / CB;
    const int base = (q >> 1) * 16 + (q & 1) * CB;  // chunk of plane 0's first 8 bytes
#pragma unroll
    for (int k = 0; k < S::CK; ++k) {
      const uint4 v = *reinterpret_cast<const uint4*>(stg + S::C0 + (k * 128 + slot) * 16);
#pragma unroll
      for (int pl = 0; pl < F; ++pl) {
        put(base + pl * 2 * CB + 2 * k, ok ? codes8<CB>(v.x, v.y, pl) : z);
        put(base + pl * 2 * CB + 2 * k + 1, ok ? codes8<CB>(v.z, v.w, pl) : z);
      }
    }
    const uint2 r = *reinterpret_cast<const uint2*>(stg + S::R0 + slot * 8);
    put(32 + q, ok ? codes8<RB>(r.x, r.y, RB == 4 ? wg : 0) : z);
    if (q != 3) {  // q 0: group a, q 2: group b, q 1: RoPE
      const bool rope = q == 1;
      const int hs = (n & 1) * 16;  // the token's half of the copied pair
      const uint32_t* m = reinterpret_cast<const uint32_t*>(stg + S::M0) + slot;
      const float sc = __half2float(__ushort_as_half((uint16_t)(m[(rope ? 2 : 0) * 128] >> hs)));
      const float bias = rope ? -(float)(1 << (RB - 1)) : -(float)(1 << (CB - 1));
      float of;
      if (rope ? RSYM : CSYM) of = bias * sc;
      else of = __half2float(__ushort_as_half((uint16_t)(m[(rope ? 3 : 1) * 128] >> hs)));
      const int ms = rope ? 2 : q >> 1;
      meta_row[ms] = ok ? sc : 0.f;
      meta_row[4 + ms] = ok ? of : 0.f;
    }
  }
};

template <int CB>
constexpr int smem_bytes() {
  if constexpr (CB == 16) return STG_SM;
  else return STG_SM + 4 * Staging<CB>::BYTES;
}

// One thread's share of a BF16-page tile half, through registers: 64 content + 8 RoPE channels of one token.
struct Bf16Tile {
  uint32_t c[32], r[4];

  __device__ __forceinline__ void load(const uint8_t* page, const Params& p, int tau, int wg, int q) {
    const uint4* src = reinterpret_cast<const uint4*>(page + p.c_off + tau * 2 * kDc + (256 * wg + 64 * q) * 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 v = __ldg(src + k);
      c[4 * k] = v.x, c[4 * k + 1] = v.y, c[4 * k + 2] = v.z, c[4 * k + 3] = v.w;
    }
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(page + p.r_off + tau * 2 * kDr + (32 * wg + 8 * q) * 2));
    r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
  }
  __device__ __forceinline__ void store(uint8_t* half, int n, int q, bool ok) const {
    uint8_t* row = half + (n >> 3) * 128 + (n & 7) * 16;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      *reinterpret_cast<uint4*>(row + (8 * q + k) * kTChunk) =
          ok ? make_uint4(c[4 * k], c[4 * k + 1], c[4 * k + 2], c[4 * k + 3]) : z;
    *reinterpret_cast<uint4*>(row + (32 + q) * kTChunk) = ok ? make_uint4(r[0], r[1], r[2], r[3]) : z;
  }
};

}  // namespace h64
}  // namespace qmla
