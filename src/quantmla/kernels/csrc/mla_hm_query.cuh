// The heads-on-M decode kernel's q staging (decode_mla_sm90_hm.cu, kernel "hm"): the CTA's 64 heads of q, scaled,
// rounded as every kernel rounds them (mla_query.cuh) and brought to fp16 under the CTA's exponent, into the
// channel-octet-major operand of the score product (mla_hm.cuh's layout).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mla_hm.cuh"
#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"

#ifndef QMLA_HM_QVEC  // 1: q staged with 16-byte loads, all in flight, when bf16 and aligned (as mla_query.cuh's
#define QMLA_HM_QVEC 1  // stage_q; the default since session 37); 0: two-byte pairs
#endif

#ifndef QMLA_HM_QREG  // 1: with QVEC's 16-byte loads, q stays in registers until the exponent is known and is then
#define QMLA_HM_QREG 1  // stored as 16-byte octets, heads fastest (a quarter-warp fills one core matrix: no bank
#endif              // conflict; the default since session 38); 0: through a bf16 copy in tile buffer 1, 8-way stores

#if defined(__CUDACC__)
namespace qmla {
namespace hm {

// a bf16 pair (one 32-bit word of q) -> floats (exact) -> * qk_scale -> bf16 pair, as scaled_q_pair; zeros unless ok
__device__ __forceinline__ __nv_bfloat162 scaled_bf16_pair(uint32_t word, bool ok, float qk_scale) {
  const float x0 = ok ? __uint_as_float(word << 16) * qk_scale : 0.f;
  const float x1 = ok ? __uint_as_float(word & 0xFFFF0000u) * qk_scale : 0.f;
  return __floats2bfloat162_rn(x0, x1);
}

// The CTA's exponent e from each thread's largest |q| (the largest lands in [2^14, 2^15) after 2^-e; mla_query.cuh's
// rule). `red`: one float per warp. Contains a CTA barrier.
__device__ __forceinline__ int cta_exponent(float amax, float* red) {
#pragma unroll
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int tid = threadIdx.x;
  if ((tid & 31) == 0) red[tid >> 5] = amax;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
  const int E = m > 0.f ? ((__float_as_int(m) >> 23) & 0xff) - 127 : 14;
  return min(max(E - 14, -100), 100);
}

// q of the CTA's heads into Q_SM as fp16(bf16(q qk_scale) 2^-e), e the CTA's exponent (mla_query.cuh: the largest
// |q| lands in [2^14, 2^15)); returns e. Scratch: tile buffer 1 (bf16 q, row-major) and F_SM's 16 floats. Ends with
// a CTA barrier.
__device__ __forceinline__ int stage_q64(uint8_t* smem, const Params& p, int b, int h0) {
  const int tid = threadIdx.x;
  constexpr int kRowPairs = (kDc + kDr) / 2, kPairs = kNH * kRowPairs;
  __nv_bfloat162* raw = reinterpret_cast<__nv_bfloat162*>(smem + T_SM + kTile);
  float* red = reinterpret_cast<float*>(smem + F_SM + kNH * 4);
  float amax = 0.f;
#if QMLA_HM_QVEC
  // bf16 q with 16-byte aligned rows: each thread's 12 chunks of 8 channels loaded first, all in flight (the pair
  // loop below issues 96 two-byte loads, each waiting for the store before it), then scaled as scaled_q_pair does
  constexpr int kChunks = kNH * (kDc + kDr) / 8, kPer = kChunks / kThreads;
  static_assert(kChunks % kThreads == 0, "q chunks per thread");
  const uintptr_t bases = reinterpret_cast<uintptr_t>(p.q_lat) | reinterpret_cast<uintptr_t>(p.q_pe);
  const long long strides = p.q_lat_sb | p.q_lat_sh | p.q_pe_sb | p.q_pe_sh;
#if QMLA_HM_QREG
  if (!p.q_fp32 && (bases & 15) == 0 && (strides & 7) == 0) {  // a uniform branch: the whole grid takes one side
    static_assert(kThreads % kNH == 0, "a thread keeps one head");
    const int hh = tid % kNH;  // f = tid + kThreads k: head f % 64 (the thread's own), octet f / 64
    const bool ok = h0 + hh < p.H;
    const int h = ok ? h0 + hh : 0;  // heads >= H: head 0, zeroed below
    const auto* ql =
        reinterpret_cast<const __nv_bfloat16*>(p.q_lat) + (long long)b * p.q_lat_sb + (long long)h * p.q_lat_sh;
    const auto* qp =
        reinterpret_cast<const __nv_bfloat16*>(p.q_pe) + (long long)b * p.q_pe_sb + (long long)h * p.q_pe_sh;
    uint4 w[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int ch = 8 * ((tid + kThreads * k) / kNH);
      w[k] = *reinterpret_cast<const uint4*>(ch < kDc ? ql + ch : qp + (ch - kDc));
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      uint32_t* wd = reinterpret_cast<uint32_t*>(&w[k]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 v = scaled_bf16_pair(wd[j], ok, p.qk_scale);
        wd[j] = *reinterpret_cast<const uint32_t*>(&v);
        amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
      }
    }
    const int e = cta_exponent(amax, red);
    const float down = exp2i(-e);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint32_t* wd = reinterpret_cast<const uint32_t*>(&w[k]);
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __half2 v = __floats2half2_rn(__uint_as_float(wd[j] << 16) * down,
                                            __uint_as_float(wd[j] & 0xFFFF0000u) * down);
        o[j] = *reinterpret_cast<const uint32_t*>(&v);
      }
      const uint32_t dst = smem_u32(smem + Q_SM + oct_offset(hh, 8 * ((tid + kThreads * k) / kNH)));
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(o[0]), "r"(o[1]), "r"(o[2]),
                   "r"(o[3])
                   : "memory");
    }
    __syncthreads();
    return e;
  }
#endif
  if (!p.q_fp32 && (bases & 15) == 0 && (strides & 7) == 0) {  // a uniform branch: the whole grid takes one side
    uint4 w[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int f = tid + kThreads * k, hh = f / ((kDc + kDr) / 8), ch = 8 * (f % ((kDc + kDr) / 8));
      const int h = h0 + hh < p.H ? h0 + hh : 0;  // heads >= H: head 0, zeroed below
      const auto* ql = reinterpret_cast<const __nv_bfloat16*>(p.q_lat);
      const auto* qp = reinterpret_cast<const __nv_bfloat16*>(p.q_pe);
      w[k] = *reinterpret_cast<const uint4*>(ch < kDc ? ql + (long long)b * p.q_lat_sb + (long long)h * p.q_lat_sh + ch
                                                      : qp + (long long)b * p.q_pe_sb + (long long)h * p.q_pe_sh +
                                                            (ch - kDc));
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int f = tid + kThreads * k, hh = f / ((kDc + kDr) / 8), ch = 8 * (f % ((kDc + kDr) / 8));
      const bool ok = h0 + hh < p.H;
      const uint32_t wd[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 v = scaled_bf16_pair(wd[j], ok, p.qk_scale);
        raw[hh * kRowPairs + ch / 2 + j] = v;
        amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
      }
    }
  } else
#endif
  for (int f = tid; f < kPairs; f += kThreads) {
    const __nv_bfloat162 v = scaled_q_pair(p, b, h0 + f / kRowPairs, 2 * (f % kRowPairs));
    raw[f] = v;
    amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
  }
  const int e = cta_exponent(amax, red);
  const float down = exp2i(-e);
  for (int f = tid; f < kPairs; f += kThreads) {
    const int h = f / kRowPairs, ch = 2 * (f % kRowPairs);
    const __nv_bfloat162 v = raw[f];
    *reinterpret_cast<__half2*>(smem + Q_SM + oct_offset(h, ch)) =
        __floats2half2_rn(__low2float(v) * down, __high2float(v) * down);
  }
  __syncthreads();
  return e;
}

}  // namespace hm
}  // namespace qmla
#endif
