// Hopper (sm_90a) warpgroup products of the heads-on-M decode kernel (decode_mla_sm90_h64.cu): the score product
// with both operands in shared memory (m64n32k16: 64 heads x 32 tokens) and the output product with the
// probabilities in registers and the values in shared memory read MN-major (m64n128k16: 64 heads x 128 channels,
// one content group). bf16 operands (the codes are exact bf16 integers).
//
// Shared-memory operands without swizzle (CUTLASS's INTERLEAVE canonical layouts): 8 x 8 core matrices of 16-bit
// elements, 128 contiguous bytes each (8 rows of 16 bytes). K-major (the score product's A = q and B = the tile):
// a row is one m / n, its 16 bytes 8 consecutive k; LBO = bytes between the two k-halves of a k-block, SBO = bytes
// between consecutive 8-row groups of m / n. MN-major (the output product's B = V, imm-trans-b 1): a row is one k
// (token), its 16 bytes 8 consecutive n (channels); LBO = bytes between consecutive 8-token groups (k), SBO = bytes
// between consecutive 8-channel groups (n). The descriptor helpers and the fences are mla_wgmma.cuh's.
//
// Fragments (warp w of the warpgroup, lane = 4 g + t): D (64 x N, fp32) d[4j + v0 + 2 v1] = (row 16w + g + 8 v1,
// column 8j + 2t + v0); A (64 x 16, registers) a0 = (row 16w+g, k 2t..2t+1), a1 = (16w+g+8, 2t..), a2 = (16w+g,
// 2t+8..), a3 = (16w+g+8, 2t+8..): the score accumulator of 16 tokens is the probability A fragment (FlashAttention-3).
#pragma once

#include <stdint.h>

namespace qmla {

// D[64 x 32] (+)= A[64 x 16] * B[16 x 32], both from shared memory (K-major), fp32 accumulators; accumulate 0:
// D = A B (the accumulators' previous values are not read: no instruction has to zero them)
#define QMLA_WGMMA_SS_N32(NAME, TYPE)                                                                  \
  __device__ __forceinline__ void NAME(float(&d)[16], uint32_t a_lo, uint32_t a_hi, uint32_t b_lo,      \
                                       uint32_t b_hi, int accumulate) {                                 \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %20, 0;\n"                                  \
        "mov.b64 da, {%16, %17};\nmov.b64 db, {%18, %19};\n"                                            \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                                    \
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, da, db, p, 1, 1, 0, 0;\n}\n"  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])  \
        : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate)                                          \
        : "memory");                                                                                   \
  }
QMLA_WGMMA_SS_N32(wgmma_ss_bf16_n32, "bf16")
#undef QMLA_WGMMA_SS_N32

// D[64 x 128] += A[64 x 16] (registers) * B[16 x 128] (shared memory, MN-major: imm-trans-b 1), fp32 accumulators
#define QMLA_WGMMA_RS_N128_T(NAME, TYPE)                                                               \
  __device__ __forceinline__ void NAME(float(&d)[64], const uint32_t(&a)[4], uint32_t b_lo, uint32_t b_hi) { \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %70, 0;\nmov.b64 db, {%68, %69};\n"             \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                               \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"  \
        "}, {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"                                                \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(1)                    \
        : "memory");                                                                                   \
  }
QMLA_WGMMA_RS_N128_T(wgmma_rs_bf16_n128_t, "bf16")
#undef QMLA_WGMMA_RS_N128_T

}  // namespace qmla
