// Hopper (sm_90a) warpgroup matrix products for the swap-AB decode kernel (decode_mla_sm90.cu): wgmma with the A
// operand in registers (the unpacked codes) and B in shared memory, read through a matrix descriptor.
//
// B layout used everywhere here ("K-major, no swizzle"): B is K x N (K = 16 per instruction), stored as 8 x 8 core
// matrices of 16-bit elements, each 128 contiguous bytes (row = one n, 16 bytes = 8 consecutive k). Core matrix
// (n-block nb, k-half kh) of a 16 x N k-block sits at nb * 256 + kh * 128: leading-dimension byte offset (between
// the two k-halves) 128, stride-dimension byte offset (between n-blocks) 256; a k-block is N * 32 bytes.
//
// Register fragments (per warp w of the warpgroup, lane = 4 g + t), as for mma.sync m16n8k16:
//   A (64 x 16): a0 = (row 16w+g, k 2t..2t+1), a1 = (row 16w+g+8, k 2t..), a2 = (row 16w+g, k 2t+8..), a3 = (16w+g+8, 2t+8..)
//   D (64 x N, fp32): d[4j + v0 + 2 v1] = (row 16w + g + 8 v1, column 8j + 2t + v0)   (N / 2 registers: 8 or 16)
// Rules (PTX ISA, wgmma): wgmma_fence() before the first wgmma of a batch whose A or accumulator registers were
// written by other instructions; an accumulator is not touched between its wgmma and the wgmma_wait that covers
// it; shared memory written with ordinary stores needs fence_proxy_async() in the writing threads and a barrier.
#pragma once

#include <stdint.h>

namespace qmla {

// Matrix descriptor of a shared-memory operand without swizzle (address, leading and stride byte offsets).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = (uint64_t)((smem_addr & 0x3FFFFu) >> 4);
  d |= (uint64_t)((lbo & 0x3FFFFu) >> 4) << 16;
  d |= (uint64_t)((sbo & 0x3FFFFu) >> 4) << 32;
  return d;  // base offset 0, layout type 0 (no swizzle)
}

// The two 32-bit halves of a descriptor; the operand `bytes` further on differs in the low half only (ptxas keeps
// the descriptors of a loop's operands in uniform registers).
struct Desc {
  uint32_t lo, hi;
  __device__ __forceinline__ explicit Desc(uint64_t d) : lo((uint32_t)d), hi((uint32_t)(d >> 32)) {}
  __device__ __forceinline__ uint32_t at(uint32_t bytes) const { return lo + (bytes >> 4); }  // no carry: < 256 KB
};

// keep the compiler from moving or copying accumulator registers across wgmma batches (one per register)
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
template <int N>
__device__ __forceinline__ void fence_operands(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(x[i]);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// D[64 x 16] += A[64 x 16] (fp16 / bf16, registers) * B[16 x 16] (shared memory), fp32 accumulators
#define QMLA_WGMMA_N16(NAME, TYPE)                                                                                 \
  __device__ __forceinline__ void NAME(float(&d)[8], const uint32_t(&a)[4], uint32_t desc_lo, uint32_t desc_hi) { \
    asm volatile(                                                                                                  \
        "{\n.reg .pred p;\n.reg .b64 desc;\nsetp.ne.b32 p, %14, 0;\nmov.b64 desc, {%12, %13};\n"                 \
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE                                                \
        " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, desc, p, 1, 1, 0;\n}\n"                            \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo), "r"(desc_hi), "r"(1)                          \
        : "memory");                                                                                               \
  }
QMLA_WGMMA_N16(wgmma_f16_n16, "f16")
QMLA_WGMMA_N16(wgmma_bf16_n16, "bf16")
#undef QMLA_WGMMA_N16


// The product for N = 16 heads (the kernel's template parameter) with the accumulator size it needs
template <int N>
__device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], const uint32_t (&a)[4], uint32_t lo, uint32_t hi) {
  static_assert(N == 16, "16 heads");
  wgmma_f16_n16(d, a, lo, hi);
}
template <int N>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], const uint32_t (&a)[4], uint32_t lo, uint32_t hi) {
  static_assert(N == 16, "16 heads");
  wgmma_bf16_n16(d, a, lo, hi);
}

// Four 8 x 8 matrices of 16-bit elements stored transposed (ldmatrix.trans's inverse): register i of lane (g = lane
// / 4, t = lane % 4) holds (row g, columns 2t, 2t + 1) of matrix i, as an accumulator fragment does; they land in
// shared-memory row 2t / 2t + 1, element g, of matrix i, whose 8 rows (16 bytes each) are at the addresses lanes
// 8 i .. 8 i + 7 give. So a fragment of S^T [tokens x heads] becomes K-major core-matrix rows of (P s)^T (one head's
// 8 tokens) in one instruction per four matrices (the ws kernel's score warpgroup, the wgmma kernel's P_STSM).
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Byte offset of the row that lane gives to stsm_x4_t for warp w's k-step of a k-block sequence (kblock bytes each)
// of (P s)^T: matrix i = lane / 8 is head octet i / 2, k-half i % 2 (registers: (ri 0, heads 0-7), (ri 1, 0-7),
// (ri 0, 8-15), (ri 1, 8-15) of a 16-head n-slice); row lane % 8 is that octet's head
__host__ __device__ constexpr int p_tile_row(int kblock, int w, int lane) {
  return w * kblock + ((lane >> 3) >> 1) * 256 + ((lane >> 3) & 1) * 128 + (lane & 7) * 16;
}

// byte offset of element (k, n) of a 16 x N k-block in the layout above
__device__ __forceinline__ int kblock_offset(int k, int n) {
  return (n >> 3) * 256 + (k >> 3) * 128 + (n & 7) * 16 + (k & 7) * 2;
}

}  // namespace qmla
