// Device primitives of the packed MLA decode kernel (decode_mla.cu): PTX wrappers (cp.async, ldmatrix, mma.sync),
// the "magic number" conversions of packed codes into exact tensor-core operands, and small float helpers.
//
// Magic numbers: a b-bit code c OR-ed into the low mantissa bits of a constant is an exact float:
//   fp16 0x6400 = 1024: (1024 + c * 2^k) for fields anywhere in the low byte of a 16-bit half (ulp 1 up to 2048);
//   bf16 0x4300 = 128:  (128 + c) for a field in the lowest bits (ulp 1 up to 256).
// One LOP3 ((x & mask) | magic) per register of two fields; the bias is removed outside the products.
// Subnormal codes (SUB, the Hopper kernel's QMLA_SM90_SUBNORMAL): a field of the low byte masked in place, with
// nothing above it, is the exact fp16 subnormal 2^k c 2^-24 (2^k c <= 255 < 2^10, the mantissa): one AND per
// register of two fields, no bias at all -- the products carry a constant 2^-24 that is undone outside them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace qmla {

constexpr uint32_t kMagicF16 = 0x64006400u;   // fp16x2 (1024, 1024)
constexpr uint32_t kMagicBf16 = 0x43004300u;  // bf16x2 (128, 128)

__device__ __forceinline__ void regs4(uint32_t (&r)[4], const uint4& v) {  // an mma A fragment from a uint4
  r[0] = v.x;
  r[1] = v.y;
  r[2] = v.z;
  r[3] = v.w;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {  // .ca: 4 and 8 bytes
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
// Programmatic dependent launch (sm_90+; with QMLA_PDL mla_launch.cuh launches the split merge and the Hopper page
// kernel with it): a kernel lets its dependent grid launch early, and a programmatically launched one waits for
// every prerequisite grid's completion and memory before it reads what they wrote. Both are no-ops for a grid
// launched without the attribute, and off sm_90. Default on since 2026-12-01: C4R4 1.08x at B1 x 128K and B32 x 4K,
// 1.00x at B32 x 32K and B8 x 128K (H200, benchmarks/results/kernel_variants_h200_s14a.md); -DQMLA_PDL=0 turns it off.
#ifndef QMLA_PDL
#define QMLA_PDL 1
#endif
__device__ __forceinline__ void pdl_launch_dependents() {
#if QMLA_PDL && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if QMLA_PDL && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// D += A (16x16 bf16, row) * B (16x8 bf16, col), fp32 accumulators
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A * B + C with fp16 operands (the first k-block of a tile's score product: C = the accumulator start)
__device__ __forceinline__ void mma_f16_c(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          float c01, float c23) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%11,%11};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c01), "f"(c23));
}

// D += A * B with fp16 operands (the score product)
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x & mask) | magic in one LOP3 (the compiler splits it in two when both constants are immediates)
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t magic) {
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(y) : "r"(x), "r"(mask), "r"(magic));
  return y;
}

// output product: field j (b bits) of both 16-bit halves of r -> bf16x2 (128 + code_lo, 128 + code_hi), exact
template <int B>
__device__ __forceinline__ uint32_t field(uint32_t r, int j) {
  return and_or(r >> (B * j), ((1u << B) - 1u) * 0x00010001u, kMagicBf16);
}

// field j of both 16-bit halves as exact bf16 codes (c_lo, c_hi): the magic number 128 + c minus 128 (one FMA)
template <int B>
__device__ __forceinline__ uint32_t code(uint32_t r, int j) {
  const uint32_t m = field<B>(r, j);
  uint32_t y;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(y) : "r"(m), "r"(0x3F803F80u), "r"(0xC300C300u));  // m * 1 - 128
  return y;
}

// plane p (field p of the low byte) of both 16-bit halves of r as exact fp16 codes (c_lo, c_hi): the magic number
// 1024 + 2^(B p) c with one LOP3 in place (2^(B p) c <= 2^8 - 2^(B p) < 1024: exact), then one fp16x2 FMA
// x 2^-(B p) - 1024 2^-(B p) (powers of two and an integer result: exact). For the upper byte pass r >> 8.
// SUB: the field masked in place, the subnormal 2^(B p) c 2^-24 (the caller undoes 2^(B p) 2^-24 per plane).
template <int B, bool SUB = false>
__device__ __forceinline__ uint32_t code_f16(uint32_t r, int p) {
  if constexpr (SUB) return r & ((((1u << B) - 1u) << (B * p)) * 0x00010001u);
  const uint32_t m = and_or(r, (((1u << B) - 1u) << (B * p)) * 0x00010001u, kMagicF16);
  const uint32_t sc = ((15u - B * p) << 10) * 0x00010001u;             // fp16 2^-(B p)
  const uint32_t bias = (0x8000u | ((25u - B * p) << 10)) * 0x00010001u;  // fp16 -2^(10 - B p)
  uint32_t y;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(y) : "r"(m), "r"(sc), "r"(bias));
  return y;
}

#ifndef QMLA_PRMT8  // 1: 8-bit codes become fp16 magic numbers with one PRMT per pair (byte b of each 16-bit half next
#define QMLA_PRMT8 1  // to the magic's 0x64 byte), not a shift + LOP3 for the upper bytes: the same bits, one SHF less
#endif                // per register (C8R8 main loop -8%; H200: C8R8 1.04-1.08x, kernel_variants_h200_s22_each.md)

// (byte b of r's low half, byte b of its high half) as fp16 1024 + byte: PRMT picks r's bytes b and b + 2 and the
// magic's 0x64 bytes (index 5 of {kMagicF16, r}) above each
// (SUB: zero bytes above them instead, the subnormals c 2^-24)
template <bool SUB = false>
__device__ __forceinline__ uint32_t magic_bytes(uint32_t r, int b) {
  uint32_t y;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(y) : "r"(r), "r"(SUB ? 0u : kMagicF16), "r"(b ? 0x5351u : 0x5250u));
  return y;
}

// byte b (0 or 1) of both 16-bit halves of r as fp16 magic numbers (1024 + c_lo, 1024 + c_hi), c in [0, 255]
__device__ __forceinline__ uint32_t magic_f16_byte(uint32_t r, int b) {
  return QMLA_PRMT8 ? magic_bytes(r, b) : and_or(b ? r >> 8 : r, 0x00FF00FFu, kMagicF16);
}

// byte b (0 or 1) of both 16-bit halves of r as exact fp16 codes (c_lo, c_hi), c in [0, 255]: the magic number
// 1024 + c minus 1024 (one LOP3 + one fp16x2 FMA; bf16 cannot hold 128 + c for c >= 128: 8-bit output products)
// (SUB: the subnormals c 2^-24 as they are)
template <bool SUB = false>
__device__ __forceinline__ uint32_t code_f16_byte(uint32_t r, int b) {
  if constexpr (SUB) return QMLA_PRMT8 ? magic_bytes<true>(r, b) : (b ? r >> 8 : r) & 0x00FF00FFu;
  const uint32_t m = magic_f16_byte(r, b);
  uint32_t y;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(y) : "r"(m), "r"(0x3C003C00u), "r"(0xE400E400u));  // m * 1 - 1024
  return y;
}

// score product: all NF = 16/B fields of both 16-bit halves of r -> fp16x2 (1024 + 2^(B p) code), p = j % (NF/2)
// the field's plane: fields of the low byte of each half straight from r, those of the high byte from r >> 8
// (one shift for all), each with one LOP3. Field j = plane j % F of half j / F (F = NF / 2 = 8 / B).
// SUB: the subnormals 2^(B p) code 2^-24 instead (no magic, no bias).
template <int B, bool SUB = false>
__device__ __forceinline__ void score_fields(uint32_t r, uint32_t (&f)[16 / B]) {
  constexpr int F = 8 / B;
  if constexpr (B == 8 && QMLA_PRMT8) {
    f[0] = magic_bytes<SUB>(r, 0);
    f[1] = magic_bytes<SUB>(r, 1);
    return;
  }
  const uint32_t r8 = r >> 8;
#pragma unroll
  for (int j = 0; j < 2 * F; ++j) {
    const uint32_t mask = (((1u << B) - 1u) << (B * (j % F))) * 0x00010001u;
    f[j] = SUB ? (j < F ? r : r8) & mask : and_or(j < F ? r : r8, mask, kMagicF16);
  }
}

__device__ __forceinline__ float ex2(float x) {  // 2^x (ex2.approx: relative error ~2^-22; 2^-inf = 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ float load_q(const void* base, long long idx, int fp32) {
  return fp32 ? reinterpret_cast<const float*>(base)[idx]
              : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[idx]);
}

}  // namespace qmla
