// Merge of the split partials of the MLA decode kernels (decode_mla.cu): one softmax over all splits.
#pragma once

#include <math.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"

namespace qmla {

// The partial slots of one sequence the merge reads: slots [0, ns_pages) are the page kernel's splits, of which only
// the first used_splits had pages (mla_page.cuh: the others' CTAs wrote nothing), and slots [ns_pages, ns) the BF16
// buffers'. lens == nullptr: every slot.
struct SplitMap {
  const int* lens;  // [B] sequence lengths (what the page kernel read)
  int sink, local, pps, ns_pages;
};

// The slots of one sequence: n of them, the k-th is slot k for k < used, else k + gap.
struct Slots {
  int n, used, gap;
  __device__ __forceinline__ int operator()(int k) const { return k < used ? k : k + gap; }
};
__device__ __forceinline__ Slots split_slots(const SplitMap& m, int b, int ns) {
  const int used = m.lens ? used_splits(m.lens[b], m.sink, m.local, m.pps, m.ns_pages) : m.ns_pages;
  return {ns - m.ns_pages + used, used, m.ns_pages - used};
}

__device__ __forceinline__ float4 fma4(float w, float4 x, float4 a) {  // w x + a, per component
  return make_float4(fmaf(w, x.x, a.x), fmaf(w, x.y, a.y), fmaf(w, x.z, a.z), fmaf(w, x.w, a.w));
}

// Merge of the split partials: out[b, h, :] = sum_s w_s po[b, s, h, :] / sum_s w_s, w_s = 2^(pl_s - max_s pl_s);
// lse = ln 2 * (max + log2 sum w). Grid (Dc / CW, H, B), CW G threads: channel tid % CW, splits tid / CW + G k
// (G split groups, 8 loads in flight each, summed through shared memory). CW = 128: G = 4 for many splits (at
// B1 x 128K, ~340 splits, one thread per channel walking every split took 35 us), 1 for few (B32: 4 groups cost
// 2x). CW = 32, G = 32 (QMLA_COMBINE_WIDE, the default): 16x the CTAs, each thread ~ns / 32 splits, one
// round of loads in flight at ~260 splits (B1 x 128K: the G = 4 merge was ~13 us of ~57).
template <int G, int D, int CW = 128>
__global__ void __launch_bounds__(CW * G) combine_kernel(const float* __restrict__ po, const float* __restrict__ pl,
                                                         float* __restrict__ out, float* __restrict__ lse, int ns,
                                                         int H, const SplitMap m) {
  constexpr int kCombineGroups = G;
  static_assert((CW == 32 || CW == 64 || CW == 128) && D % CW == 0 && CW * G <= 1024, "channel block");
  constexpr int kShift = CW == 128 ? 7 : CW == 64 ? 6 : 5;  // log2 CW
  const int dc = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, ch = tid & (CW - 1),
            grp = tid >> kShift;
  __shared__ float red[CW * kCombineGroups / 32];
  __shared__ float racc[kCombineGroups][CW], rws[kCombineGroups][CW];
  pdl_wait();  // launched early (QMLA_PDL): the page kernel's partials are complete and visible from here on
  const Slots sl = split_slots(m, b, ns);  // this sequence's slots with partials (k-th: slot sl(k))
  const float* plb = pl + (long long)b * ns * H + h;  // pl[b, s, h] = plb[s * H]
  float mx = -INFINITY;
  for (int s = tid; s < sl.n; s += CW * kCombineGroups) mx = fmaxf(mx, plb[(long long)sl(s) * H]);
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < CW * kCombineGroups / 32; ++w) mx = fmaxf(mx, red[w]);
  const float msafe = mx == -INFINITY ? 0.f : mx;
  const float* pob = po + ((long long)b * ns * H + h) * D + dc * CW + ch;  // po[b, s, h, d] = pob[s * H * Dc]
  const long long step = (long long)H * D;
  constexpr int U = 8;
  float acc[U], wsum[U];
#pragma unroll
  for (int u = 0; u < U; ++u) acc[u] = wsum[u] = 0.f;
  int s = grp;
  for (; s + kCombineGroups * (U - 1) < sl.n; s += kCombineGroups * U) {
    float w[U], x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int su = sl(s + kCombineGroups * u);
      w[u] = plb[(long long)su * H];
      x[u] = pob[su * step];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float wu = ex2(w[u] - msafe);
      wsum[u] += wu;
      acc[u] = wu > 0.f ? fmaf(wu, x[u], acc[u]) : acc[u];  // (an empty split's partial output is 0 anyway)
    }
  }
  for (; s < sl.n; s += kCombineGroups) {
    const int su = sl(s);
    const float w = ex2(plb[(long long)su * H] - msafe);
    wsum[0] += w;
    acc[0] = w > 0.f ? fmaf(w, pob[su * step], acc[0]) : acc[0];
  }
  float a = 0.f, ws = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    a += acc[u];
    ws += wsum[u];
  }
  if (G > 1) {
    racc[grp][ch] = a;
    rws[grp][ch] = ws;
    __syncthreads();
  }
  if (grp == 0) {
#pragma unroll
    for (int g2 = 1; g2 < kCombineGroups; ++g2) {
      a += racc[g2][ch];
      ws += rws[g2][ch];
    }
    out[((long long)b * H + h) * D + dc * CW + ch] = ws > 0.f ? a / ws : 0.f;
    if (dc == 0 && ch == 0) lse[(long long)b * H + h] = ws > 0.f ? (mx + log2f(ws)) * 0.6931471805599453f : -INFINITY;
  }
}

// The same merge with 16-byte accesses (QMLA_COMBINE_V4): one CTA per (128-channel chunk, head, sequence) of W
// warps; lane l holds channels 4 l .. 4 l + 3 of the chunk (one float4 per split), warp w sums the splits w, w + W,
// ... in rounds of U loads all in flight, and every warp finds the largest pl over all splits itself (no barrier
// before the sums; one at the end for W > 1). The scalar merge above: 4x the load instructions and one barrier
// more; at B32 x 512 (9 splits) it took 12.7 us under ncu for 9 MB (ncu 2026-12-01, 2048 CTAs, IPC-bound).
template <int W, int D>
__global__ void __launch_bounds__(32 * W) combine4_kernel(const float* __restrict__ po, const float* __restrict__ pl,
                                                          float* __restrict__ out, float* __restrict__ lse, int ns,
                                                          int H, const SplitMap m) {
  constexpr int U = 8;
  const int dc = blockIdx.x, h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  pdl_wait();
  const Slots sl = split_slots(m, b, ns);  // this sequence's slots with partials (k-th: slot sl(k))
  const float* plb = pl + (long long)b * ns * H + h;  // pl[b, s, h] = plb[s * H]
  float mx = -INFINITY;
  for (int s = lane; s < sl.n; s += 32) mx = fmaxf(mx, plb[(long long)sl(s) * H]);
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float msafe = mx == -INFINITY ? 0.f : mx;
  const float4* pob = reinterpret_cast<const float4*>(po + ((long long)b * ns * H + h) * D + dc * 128) + lane;
  const long long step = (long long)H * D / 4;  // float4s between splits
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float ws = 0.f;  // the same in every lane
  for (int s0 = w; s0 < sl.n; s0 += W * U) {
    float wv[U];
    float4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + W * u, su = sl(s);
      wv[u] = s < sl.n ? plb[(long long)su * H] : -INFINITY;
      x[u] = s < sl.n ? pob[su * step] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float e = ex2(wv[u] - msafe);
      ws += e;
      if (e > 0.f) acc = fma4(e, x[u], acc);  // (an empty split's partial output is 0 anyway)
    }
  }
  if constexpr (W > 1) {
    __shared__ float4 racc[W][32];
    __shared__ float rws[W];
    racc[w][lane] = acc;
    if (lane == 0) rws[w] = ws;
    __syncthreads();
    if (w != 0) return;
#pragma unroll
    for (int k = 1; k < W; ++k) {
      const float4 a = racc[k][lane];
      acc.x += a.x;
      acc.y += a.y;
      acc.z += a.z;
      acc.w += a.w;
      ws += rws[k];
    }
  }
  const float4 o = ws > 0.f ? make_float4(acc.x / ws, acc.y / ws, acc.z / ws, acc.w / ws)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
  reinterpret_cast<float4*>(out + ((long long)b * H + h) * D + dc * 128)[lane] = o;
  if (dc == 0 && lane == 0) lse[(long long)b * H + h] = ws > 0.f ? (mx + log2f(ws)) * 0.6931471805599453f : -INFINITY;
}

}  // namespace qmla
