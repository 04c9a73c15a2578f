// The split merge inside the page kernel (QMLA_FUSED_MERGE, off by default until measured; Params::arrivals set by
// quantmla/kernels/cuda_decode.py): every CTA of a (sequence, head group) that writes a partial counts in after it,
// and the last to arrive merges the sequence's partials for its heads -- the merge kernel's arithmetic
// (mla_combine.cuh), over the same slots -- and sets the count back to zero for the next call (a CUDA-graph replay
// needs no memset). Nobody waits for anybody: no co-residency is assumed.
//
// What it removes: the merge kernel after the page kernel, ~6 us at B32 x 32K of a ~170-190 us call
// (decode_trace_h200_s14pdl.md). What it costs: the last CTA of each (sequence, head group) reads the sequence's
// partials alone (splits x 16 heads x 2 KB, from L2), so cuda_decode.py fuses only up to FUSED_MAX_SLOTS slots.
//
// Ordering: each thread's partial stores, then __threadfence, then the CTA's one atomicAdd (a release); the last CTA
// fences again (an acquire) and reads the partials with ld.global.cg (L2: the other SMs' L1s are not coherent). The
// BF16 buffers' partials are visible only where the page kernel waited for the buffer kernel (Params::pdl_late: at
// its end, before this) -- cuda_decode.py fuses only then, or when there are no buffer slots.
#pragma once

#include <math.h>
#include <stdint.h>

#include "mla_combine.cuh"
#include "mla_ops.cuh"
#include "mla_page.cuh"

#ifndef QMLA_FUSED_MERGE
#define QMLA_FUSED_MERGE 0
#endif

namespace qmla {

// The splits of a sequence that count in: those with pages, and split 0 always (its CTA then writes an empty
// partial: a sequence without pages still needs one CTA to write its output).
__device__ __forceinline__ int arriving_splits(const Params& p, int b) {
  const int used = used_splits(p.lens[b], p.sink, p.local, p.pps, gridDim.y);
  return used > 1 ? used : 1;
}

// mla_page.cuh's empty_split_leaves for the Hopper page kernel: with the merge in the kernel split 0 always stays
// (see arriving_splits).
__device__ __forceinline__ bool empty_split_leaves(const Params& p, int sp, int pg0, int pg1) {
  return empty_split_leaves(p, pg0, QMLA_FUSED_MERGE && p.arrivals && sp == 0 ? pg0 + 1 : pg1);
}

// Count this CTA in; the last one merges: out[b, h, :] and lse[b, h] for h in [h0, h0 + NH) (8 threads per head,
// lane c of a head holds float4 columns c, c + 8, ..., c + 120 of the 512 channels). Call with every thread of the
// CTA, after its partial is written (and, with pdl_late, after its wait for the buffer kernel); flag: one int of
// shared memory nobody reads any more (a static __shared__ one would add 128 B to every CTA's shared memory).
template <int NH, int kThreads>
__device__ __forceinline__ void merge_in_kernel(const Params& p, int b, int hg, int h0, int* flag) {
  static_assert(kThreads == 8 * NH && kDc == 8 * 4 * 16, "8 threads per head, 16 float4 columns each");
  constexpr int J = kDc / 32;  // float4 columns per thread
  __threadfence();  // this thread's partial is visible device-wide before the CTA counts in
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = p.arrivals + (long long)b * gridDim.x + hg;
    const bool last = atomicAdd(count, 1) == arriving_splits(p, b) - 1;
    if (last) atomicExch(count, 0);  // every CTA of this call has counted in: zero for the next call
    *flag = last;
  }
  __syncthreads();
  if (!*flag) return;
  __threadfence();  // the other CTAs' partials: read below through L2
  const int h = h0 + (int)threadIdx.x / 8, c = threadIdx.x % 8;
  if (h >= p.H) return;
  const Slots sl = split_slots(SplitMap{p.lens, p.sink, p.local, p.pps, (int)gridDim.y}, b, p.ns_total);
  const long long row0 = (long long)b * p.ns_total * p.H + h;  // pl[b, s, h] = p.pl[row0 + s H]
  float mx = -INFINITY;
  for (int k = 0; k < sl.n; ++k) mx = fmaxf(mx, __ldcg(p.pl + row0 + (long long)sl(k) * p.H));
  const float msafe = mx == -INFINITY ? 0.f : mx;
  float4 acc[J];
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  float ws = 0.f;
  // slot k + 1's loads are issued before slot k's FMAs (two slots in flight: 32 16-byte loads per thread)
  auto load = [&](int k, float4 (&x)[J]) {
    const float4* src = reinterpret_cast<const float4*>(p.po + (row0 + (long long)sl(k) * p.H) * kDc) + c;
#pragma unroll
    for (int j = 0; j < J; ++j) x[j] = __ldcg(src + 8 * j);
  };
  float4 x[J], xn[J];
  if (sl.n > 0) load(0, x);
  for (int k = 0; k < sl.n; ++k) {
    const float w = ex2(__ldcg(p.pl + row0 + (long long)sl(k) * p.H) - msafe);
    if (k + 1 < sl.n) load(k + 1, xn);
    ws += w;
    if (w > 0.f) {  // (an empty split's partial is never read as a number)
#pragma unroll
      for (int j = 0; j < J; ++j) acc[j] = fma4(w, x[j], acc[j]);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) x[j] = xn[j];
  }
  float4* dst = reinterpret_cast<float4*>(p.out + ((long long)b * p.H + h) * kDc) + c;
#pragma unroll
  for (int j = 0; j < J; ++j)
    dst[8 * j] = ws > 0.f ? make_float4(acc[j].x / ws, acc[j].y / ws, acc[j].z / ws, acc[j].w / ws)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
  if (c == 0) p.lse[(long long)b * p.H + h] = ws > 0.f ? (mx + log2f(ws)) * 0.6931471805599453f : -INFINITY;
}

}  // namespace qmla
