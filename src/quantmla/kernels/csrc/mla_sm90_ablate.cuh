// Ablations of the Hopper decode kernel (decode_mla_sm90.cu): where a tile's time goes, by taking one part away.
// Timing only -- an ablated build computes a wrong result on purpose (benchmarks/kernel_variants.py keeps its rows and
// says so; its GPU tests are not run). QMLA_SM90_ABLATE is a bit mask, 0 (the default) compiles to the kernel itself
// (the same SASS, instruction for instruction):
//   1  the score product's wgmma are not issued -- and ptxas then drops their operands' unpacking too (it puts an
//      empty HGMMA.64x8x16 on zero registers in each commit group left without a product)
//   2  the output product's wgmma are not issued (likewise)
//   4  the codes are not unpacked: the ldmatrix words enter both products as they are (every wgmma still runs)
//   8  every tile of every CTA copies the pool's page 0 (L2-resident after the first copy) instead of its own page
//      (min(block, 0): the block-table reads stay, one instruction more): DRAM is out of the loop
// So T(base) - T(4) is what the unpacking costs, T(4) - T(1 | 2 | 4) what the tensor-core products cost with their
// operands ready, T(base) - T(8) what waiting for DRAM costs; static instruction counts: benchmarks/sass_loop.py -D.
#pragma once

#include <stdint.h>

#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"

#ifndef QMLA_SM90_ABLATE
#define QMLA_SM90_ABLATE 0
#endif

namespace qmla {
namespace sm90 {

constexpr int kAblate = QMLA_SM90_ABLATE;
constexpr int kAblateScore = 1, kAblateOutput = 2, kAblateUnpack = 4, kAblateDram = 8;
static_assert(kAblate >= 0 && kAblate < 16, "QMLA_SM90_ABLATE: a mask of 1, 2, 4, 8");

// D += A x B in fp16 / bf16 (mla_wgmma.cuh), unless ablation bit BIT is set
template <int BIT, int N>
__device__ __forceinline__ void product_f16(float (&d)[N / 2], const uint32_t (&a)[4], uint32_t lo, uint32_t hi) {
  if constexpr ((kAblate & BIT) == 0) wgmma_f16<N>(d, a, lo, hi);
}
template <int BIT, int N>
__device__ __forceinline__ void product_bf16(float (&d)[N / 2], const uint32_t (&a)[4], uint32_t lo, uint32_t hi) {
  if constexpr ((kAblate & BIT) == 0) wgmma_bf16<N>(d, a, lo, hi);
}

// the A fragments of one ldmatrix batch without unpacking: register i of every fragment is word i
template <int H, int FF>
__device__ __forceinline__ void raw_frags(const uint32_t (&R)[4], uint32_t (&a)[H][FF][4]) {
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int f = 0; f < FF; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[h][f][i] = R[i];
}

// the score product's A fragments of one batch (mla_swapab.cuh score_frags), or the raw words (bit 4)
template <int B, bool SUB>
__device__ __forceinline__ void score_a(const uint32_t (&R)[4], uint32_t (&a)[2][8 / B][4]) {
  if constexpr ((kAblate & kAblateUnpack) != 0)
    raw_frags(R, a);
  else
    score_frags<B, SUB>(R, a);
}

}  // namespace sm90
}  // namespace qmla
