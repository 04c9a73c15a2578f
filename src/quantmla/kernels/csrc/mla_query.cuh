// The query side of the packed MLA decode kernels (decode_mla.cu, decode_mla_sm90.cu): a CTA's heads of q staged once
// in shared memory as bf16(q * qk_scale) (the rounding the tests' reference uses), and the CTA's exponent e that
// scales its largest |q| into [2^14, 2^15) for the fp16 score product (fp16 can then neither overflow nor go
// subnormal above 2^-28 of it; scores are carried in 2^-e units until the softmax).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"

#ifndef QMLA_Q_VEC  // 1: stage_q loads bf16 q 16 bytes at a time when aligned (every kernel); default since
#define QMLA_Q_VEC 1  // 2026-12-01 (H200: 0-3% faster: kernel_variants_h200_s12.md)
#endif

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

// The same value without a branch (heads >= H load head 0 and drop it), so that a stager's loads can all be issued
// before any is used.
__device__ __forceinline__ __nv_bfloat162 scaled_q_pair_nb(const Params& p, int b, int h, int ch) {
  const bool ok = h < p.H;
  const int hc = ok ? h : 0;
  const void* q = ch < kDc ? p.q_lat : p.q_pe;
  const long long i = ch < kDc ? (long long)b * p.q_lat_sb + (long long)hc * p.q_lat_sh + ch
                               : (long long)b * p.q_pe_sb + (long long)hc * p.q_pe_sh + (ch - kDc);
  const float x0 = load_q(q, i, p.q_fp32), x1 = load_q(q, i + 1, p.q_fp32);
  return __floats2bfloat162_rn(ok ? x0 * p.qk_scale : 0.f, ok ? x1 * p.qk_scale : 0.f);
}

// Stage q [HEADS heads from h0][576] of sequence b into qst (bf16, zeros for heads >= H): pairs of channels,
// consecutive threads on consecutive pairs (coalesced). `scratch` holds one float per warp. Ends with a CTA barrier;
// returns e. IN_FLIGHT: all of a thread's loads first (branch-free), then the stores -- the compiler cannot tell the
// shared-memory stores from the global loads (generic pointers), so interleaved, each load waits for the one before
// (ncu 2026-12-01: 8% of the wgmma kernel's stall samples at B32 x 32K, one global round trip per pair). The mma
// kernel keeps the interleaved form: on sm_80, under its 168-register cap, the in-flight one spills.
// ROW: qst's row stride in elements (>= 576, a multiple of 8; 576 + 8 puts the rows of 8 heads on distinct banks for
// 16-byte reads across heads, as the Hopper kernel's stage_qt does).
template <int HEADS, int THREADS, bool IN_FLIGHT = false, int ROW = kDc + kDr>
__device__ __forceinline__ int stage_q(__nv_bfloat16* qst, float* scratch, const Params& p, int b, int h0) {
  constexpr int kPairs = HEADS * (kDc + kDr) / 2, kPerThread = kPairs / THREADS, kWarpsQ = THREADS / 32;
  static_assert(kPairs % THREADS == 0 && kWarpsQ == 4, "q pairs per thread, four warps");
  static_assert(ROW >= kDc + kDr && ROW % 8 == 0, "q row stride");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __nv_bfloat162* qst2 = reinterpret_cast<__nv_bfloat162*>(qst);
  auto at2 = [](int f) {  // flat channel pair f (head-major, 288 per head) -> its bf16x2 slot in qst
    return ROW == kDc + kDr ? f : f / ((kDc + kDr) / 2) * (ROW / 2) + f % ((kDc + kDr) / 2);
  };
  float amax = 0.f;
#if QMLA_Q_VEC
  // bf16 q with 16-byte aligned rows: 8 channels of one head per load, kChunks / THREADS loads per thread, all in
  // flight (the pair path issues 8x as many 2-byte loads); a uniform branch (the whole grid takes the same side)
  constexpr int kChunks = HEADS * (kDc + kDr) / 8;
  const uintptr_t bases = reinterpret_cast<uintptr_t>(p.q_lat) | reinterpret_cast<uintptr_t>(p.q_pe);
  const long long strides = p.q_lat_sb | p.q_lat_sh | p.q_pe_sb | p.q_pe_sh;
  const bool vec = !p.q_fp32 && (bases & 15) == 0 && (strides & 7) == 0;
  if (vec) {
    static_assert(kChunks % THREADS == 0, "q chunks per thread");
    uint4 raw[kChunks / THREADS];
#pragma unroll
    for (int k = 0; k < kChunks / THREADS; ++k) {
      const int f = tid + THREADS * k, hh = f / ((kDc + kDr) / 8), ch = 8 * (f % ((kDc + kDr) / 8));
      const int h = h0 + hh < p.H ? h0 + hh : 0;  // heads >= H: load head 0, zeroed below
      const auto* ql = reinterpret_cast<const __nv_bfloat16*>(p.q_lat);
      const auto* qp = reinterpret_cast<const __nv_bfloat16*>(p.q_pe);
      const __nv_bfloat16* q = ch < kDc ? ql + (long long)b * p.q_lat_sb + (long long)h * p.q_lat_sh + ch
                                        : qp + (long long)b * p.q_pe_sb + (long long)h * p.q_pe_sh + (ch - kDc);
      raw[k] = *reinterpret_cast<const uint4*>(q);
    }
#pragma unroll
    for (int k = 0; k < kChunks / THREADS; ++k) {
      const int f = tid + THREADS * k, hh = f / ((kDc + kDr) / 8), ch = 8 * (f % ((kDc + kDr) / 8));
      const bool ok = h0 + hh < p.H;
      uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // bf16 pair -> floats (exact) -> * qk_scale -> bf16 pair, as scaled_q_pair
        const float x0 = ok ? __uint_as_float(w[j] << 16) * p.qk_scale : 0.f;
        const float x1 = ok ? __uint_as_float(w[j] & 0xFFFF0000u) * p.qk_scale : 0.f;
        const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
        amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
        w[j] = *reinterpret_cast<const uint32_t*>(&v);
      }
      *reinterpret_cast<uint4*>(qst + hh * ROW + ch) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else
#endif
  if constexpr (IN_FLIGHT) {
    __nv_bfloat162 v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int f = tid + THREADS * k, hh = f / ((kDc + kDr) / 2), ch = 2 * (f % ((kDc + kDr) / 2));
      v[k] = scaled_q_pair_nb(p, b, h0 + hh, ch);
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      amax = fmaxf(amax, fmaxf(fabsf(__low2float(v[k])), fabsf(__high2float(v[k]))));
      qst2[at2(tid + THREADS * k)] = v[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int f = tid + THREADS * k, hh = f / ((kDc + kDr) / 2), ch = 2 * (f % ((kDc + kDr) / 2));
      const __nv_bfloat162 v = scaled_q_pair(p, b, h0 + hh, ch);
      amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
      qst2[at2(f)] = v;
    }
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
