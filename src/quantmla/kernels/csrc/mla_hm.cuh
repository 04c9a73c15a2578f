// The heads-on-M many-heads decode kernel (decode_mla_sm90_hm.cu, kernel "hm"): its shared-memory layout, the
// warpgroup products it uses, and the unpacking of one 16-byte chunk of codes into fp16 values s c + o.
//
// One CTA = 64 heads (M of every product) x one split x one sequence, three warpgroups: WG 0 produces (the packed
// page -> the fp16 values s c + o of a 64 x 576 tile in shared memory, once per CTA), WG 1 + c (c = 0, 1) consume
// tiles 2k + c (FlashMLA's split): the score product of the own tile, its softmax, and the output product of its 256
// channels over both tiles of an iteration. Why and how fast: docs/kernels.md "Many heads
// on M with a producer warpgroup" (the timing skeleton benchmarks/micro/hm_tile.cu).
//
// Shared-memory operands without swizzle (CUTLASS's INTERLEAVE canonical layouts), 8 x 8 core matrices of 16-bit
// elements (fp16 here), 128 contiguous bytes each. q and a tile are channel-octet-major: element (row r, channel ch) at
// (ch / 8) * 1024 + (r / 8) * 128 + (r % 8) * 16 + (ch % 8) * 2 (r = head for q, token for a tile). K-major reads
// (the score product, A = q, B = the tile): a k-step of 16 channels starts at octet 2 kk, LBO 1024 (the next 8
// channels), SBO 128 (the next 8 rows). MN-major read of a tile (the output product's B = V: k = tokens, n =
// channels): LBO 128 (the next 8 tokens), SBO 1024 (the next 8 channels), imm-trans-b 1. The published P (read with
// ldmatrix) uses the same form with tokens as the channel axis: (head, token) at (token / 8) * 1024 + (head / 8) * 128
// + (head % 8) * 16 + (token % 8) * 2.
#pragma once

#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"

namespace qmla {
namespace hm {

constexpr int kWg = 128;
constexpr int kThreads = 3 * kWg;
constexpr int kNH = 64;      // heads per CTA
constexpr int kOct = 1024;   // one channel octet of 64 rows x 16 bytes
constexpr int kTile = 72 * kOct;  // a 64 x 576 fp16 tile (also q)

constexpr int Q_SM = 0;                  // q: fp16(bf16(q qk_scale) 2^-e), [72 octets][64 heads][8]
constexpr int T_SM = Q_SM + kTile;       // [2] tiles of fp16 values s c + o (zeros outside [lo, hi))
constexpr int P_SM = T_SM + 2 * kTile;   // the published P (fp16, in the publisher's frame) [8 token octets][64][8]
constexpr int F_SM = P_SM + 8 * kOct;    // [64] floats: the publisher's running maximum per head; [16] scratch
constexpr int B_SM = F_SM + kNH * 4 + 64;  // mbarriers: full[5 groups][2], empty[2]
constexpr int SMEM = B_SM + 12 * 8;
static_assert(SMEM <= 227 * 1024, "shared memory");
static_assert(T_SM % 1024 == 0 && P_SM % 1024 == 0 && B_SM % 8 == 0, "alignment");

// The pipeline's mbarriers (offsets from B_SM) and the phase parities waited on: full[group][buffer] (the producer's
// 128 threads) completes once per fill of the buffer, so consumer c waits for its tile 2k + c with parity k & 1;
// empty[buffer] (both consumers' 256 threads) once per release, so the producer's tile `it` >= 2 (buffer it & 1) waits
// for release (it >> 1) - 1. tests/kernels/test_hm_protocol.py runs the protocol with these functions' values.
__host__ __device__ constexpr int full_bar(int g, int b) { return 8 * (2 * g + b); }
__host__ __device__ constexpr int empty_bar(int b) { return 80 + 8 * b; }
__host__ __device__ constexpr int full_parity(int k) { return k & 1; }
__host__ __device__ constexpr int empty_parity(int it) { return ((it >> 1) - 1) & 1; }

// byte offset of (row, channel) in a channel-octet-major 64-row operand
__host__ __device__ constexpr int oct_offset(int row, int ch) {
  return (ch >> 3) * kOct + (row >> 3) * 128 + (row & 7) * 16 + (ch & 7) * 2;
}

// The producer's content chunks (two threads per token, `half` 0 / 1; NCH = 256 CB / 128 chunks of 16 bytes each):
// chunk i of a thread is chunk x = CPG (i / HPG) + 2 (i % HPG) + half of the token's row (CPG = CB chunks per
// quantization group of 128 channels, HPG = CPG / 2 of them per thread), i.e. group i / HPG at a compile-time index.
// Its byte offset in the token's content row, and the first channel octet of plane 0 it fills (plane p adds 2 CB p
// octets: plane stride 16 CB channels): tests/kernels/test_cuda_compile.py checks both against quant/packing.py.
template <int CB>
__host__ __device__ constexpr int chunk_byte(int i, int half) {
  return 16 * (CB * (i / (CB / 2)) + 2 * (i % (CB / 2)) + half);
}
template <int CB>
__host__ __device__ constexpr int chunk_octet(int i, int half) {
  return 16 * (i / (CB / 2)) + 4 * (i % (CB / 2)) + 2 * half;
}

#if defined(__CUDACC__)
#define QMLA_HM_F8(x, o) "+f"(x[o]), "+f"(x[o + 1]), "+f"(x[o + 2]), "+f"(x[o + 3]), "+f"(x[o + 4]), "+f"(x[o + 5]), \
                         "+f"(x[o + 6]), "+f"(x[o + 7])

// S[64 x 64] (+)= A[64 x 16] B[16 x 64]^T, both K-major in shared memory (fp16), fp32 accumulators; accumulate 0
// overwrites. Descriptors as 32-bit halves (mla_wgmma.cuh's Desc: ptxas keeps them in uniform registers).
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint32_t a_lo, uint32_t a_hi, uint32_t b_lo,
                                             uint32_t b_hi, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\nmov.b64 da, {%32, %33};\nmov.b64 db, {%34, %35};\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,"
      "%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, da, db, p, 1, 1, 0, 0;\n}\n"
      : QMLA_HM_F8(d, 0), QMLA_HM_F8(d, 8), QMLA_HM_F8(d, 16), QMLA_HM_F8(d, 24)
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate)
      : "memory");
}

// O[64 x 256] += A[64 x 16] (registers, fp16) B[16 x 256] (shared memory, MN-major), fp32 accumulators
__device__ __forceinline__ void wgmma_rs_n256_t(float (&d)[128], const uint32_t (&a)[4], uint32_t b_lo, uint32_t b_hi) {
  asm volatile(
      "{\n.reg .b64 db;\nmov.b64 db, {%132, %133};\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,"
      "%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,"
      "%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,"
      "%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,"
      "%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128, %129,"
      " %130, %131}, db, 1, 1, 1, 1;\n}\n"
      : QMLA_HM_F8(d, 0), QMLA_HM_F8(d, 8), QMLA_HM_F8(d, 16), QMLA_HM_F8(d, 24), QMLA_HM_F8(d, 32),
        QMLA_HM_F8(d, 40), QMLA_HM_F8(d, 48), QMLA_HM_F8(d, 56), QMLA_HM_F8(d, 64), QMLA_HM_F8(d, 72),
        QMLA_HM_F8(d, 80), QMLA_HM_F8(d, 88), QMLA_HM_F8(d, 96), QMLA_HM_F8(d, 104), QMLA_HM_F8(d, 112),
        QMLA_HM_F8(d, 120)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi)
      : "memory");
}
#undef QMLA_HM_F8

#ifndef QMLA_HM_INPLACE  // 1: each field unpacked in place under its own magic number (no shift, one LOP3; the
#define QMLA_HM_INPLACE 1  // producer's loop 870 -> ~660 SASS instructions per tile, C4R4; the default since session
#endif                     // 37: 1.06-1.08x alone, H100); 0: shifted down under 1024

// Two fp16 values s c + o of field p (bits [p B, (p + 1) B)) of bytes 0 and 1 of x (x = PRMT of a word: [b, 0, b',
// 0]): 2^k + c exactly under a magic number 2^k whose ulp is 1 at the field's position, minus the magic exact, then
// one rounding of the fused s c + o. In place (QMLA_HM_INPLACE) the magic is 2^(10 - p B) (ulp 2^-(p B): the field
// need not move) and the mask and magic are registers (one LOP3); else the field is shifted down under 1024.
template <int B>
__device__ __forceinline__ uint32_t f16_values(uint32_t x, int p, uint32_t s2, uint32_t o2) {
#if QMLA_HM_INPLACE
  const uint32_t magic = ((uint32_t)(25 - B * p) << 10) * 0x00010001u;  // fp16 bits of 2^(10 - p B), both halves
  uint32_t v = and_or(x, (((1u << B) - 1) << (B * p)) * 0x00010001u, magic);
#else
  const uint32_t magic = 0x64006400u;  // 1024
  uint32_t v = ((x >> (p * B)) & (((1u << B) - 1) * 0x00010001u)) | magic;
#endif
  asm("sub.rn.f16x2 %0, %0, %1;\n" : "+r"(v) : "r"(magic));
  asm("fma.rn.f16x2 %0, %0, %1, %2;\n" : "+r"(v) : "r"(s2), "r"(o2));
  return v;
}

// Unpack one 16-byte chunk of B-bit codes, planar with plane stride PS channels (byte j holds channel j + p PS of
// plane p), with the token's scale and offset (fp16 pairs s2, o2), into the token's rows of a tile: `row` is the
// address of the token's 16-byte row in channel octet 0 plus any run-time octet offset, `oct` the chunk's first
// channel octet of plane 0 (a constant after unrolling: every store gets an immediate offset). Per plane two rows
// (octets oct + p PS / 8 and + 1).
template <int B, int PS>
__device__ __forceinline__ void unpack_chunk(uint32_t row, int oct, const uint4& w, uint32_t s2, uint32_t o2) {
  const uint32_t wd[4] = {w.x, w.y, w.z, w.w};
  const uint32_t x[4][2] = {{__byte_perm(wd[0], 0, 0x4140), __byte_perm(wd[0], 0, 0x4342)},
                            {__byte_perm(wd[1], 0, 0x4140), __byte_perm(wd[1], 0, 0x4342)},
                            {__byte_perm(wd[2], 0, 0x4140), __byte_perm(wd[2], 0, 0x4342)},
                            {__byte_perm(wd[3], 0, 0x4140), __byte_perm(wd[3], 0, 0x4342)}};
#pragma unroll
  for (int p = 0; p < 8 / B; ++p) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // channels 8h .. 8h + 7 of the plane: words 2h, 2h + 1
      const uint32_t o0 = f16_values<B>(x[2 * h][0], p, s2, o2), o1 = f16_values<B>(x[2 * h][1], p, s2, o2);
      const uint32_t o2v = f16_values<B>(x[2 * h + 1][0], p, s2, o2), o3 = f16_values<B>(x[2 * h + 1][1], p, s2, o2);
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + (oct + p * PS / 8 + h) * kOct), "r"(o0),
                   "r"(o1), "r"(o2v), "r"(o3)
                   : "memory");
    }
  }
}
#endif

}  // namespace hm
}  // namespace qmla
