// The query side of the packed MLA decode kernels (decode_mla.cu, decode_mla_sm90.cu): a CTA's heads of q staged once
// in shared memory as bf16(q * qk_scale) (the rounding the tests' reference uses), and the CTA's exponent e that
// scales its largest |q| into [2^14, 2^15) for the fp16 score product (fp16 can then neither overflow nor go
// subnormal above 2^-28 of it; scores are carried in 2^-e units until the softmax).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"

namespace qmla {

// bf16(q * qk_scale) of channels ch, ch + 1 (of the 576: latent, then RoPE) of head h of sequence b (the rounding
// the tests' reference uses); zeros for heads >= H
__device__ __forceinline__ __nv_bfloat162 scaled_q_pair(const Params& p, int b, int h, int ch) {
  float x0 = 0.f, x1 = 0.f;
  if (h < p.H) {
    const void* q = ch < kDc ? p.q_lat : p.q_pe;
    const long long i = ch < kDc ? (long long)b * p.q_lat_sb + (long long)h * p.q_lat_sh + ch
                                 : (long long)b * p.q_pe_sb + (long long)h * p.q_pe_sh + (ch - kDc);
    x0 = load_q(q, i, p.q_fp32) * p.qk_scale;
    x1 = load_q(q, i + 1, p.q_fp32) * p.qk_scale;
  }
  return __floats2bfloat162_rn(x0, x1);
}

// Stage q [HEADS heads from h0][576] of sequence b into qst (bf16, zeros for heads >= H): pairs of channels,
// consecutive threads on consecutive pairs (coalesced), every load in flight. `scratch` holds one float per warp.
// Ends with a CTA barrier; returns e.
template <int HEADS, int THREADS>
__device__ __forceinline__ int stage_q(__nv_bfloat16* qst, float* scratch, const Params& p, int b, int h0) {
  constexpr int kPairs = HEADS * (kDc + kDr) / 2, kPerThread = kPairs / THREADS, kWarpsQ = THREADS / 32;
  static_assert(kPairs % THREADS == 0 && kWarpsQ == 4, "q pairs per thread, four warps");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __nv_bfloat162* qst2 = reinterpret_cast<__nv_bfloat162*>(qst);
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int f = tid + THREADS * k, hh = f / ((kDc + kDr) / 2), ch = 2 * (f % ((kDc + kDr) / 2));
    const __nv_bfloat162 v = scaled_q_pair(p, b, h0 + hh, ch);
    amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
    qst2[f] = v;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) scratch[warp] = amax;
  __syncthreads();
  const float m = fmaxf(fmaxf(scratch[0], scratch[1]), fmaxf(scratch[2], scratch[3]));
  const int E = m > 0.f ? ((__float_as_int(m) >> 23) & 0xff) - 127 : 14;
  return min(max(E - 14, -100), 100);
}

__device__ __forceinline__ float exp2i(int e) { return __int_as_float((127 + e) << 23); }  // 2^e, |e| <= 126

}  // namespace qmla
