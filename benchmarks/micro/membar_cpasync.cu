// Does the decode kernel's proxy fence wait for the next page's copy? decode_mla_sm90.cu writes the softmax's (P s)^T
// tiles with ordinary stores, then `fence.proxy.async.shared::cta` + __syncthreads before the output product's wgmma
// read them; ptxas emits that fence as MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (SASS, session 31). The next page's
// cp.async (LDGSTS) was issued at the top of the same tile and is usually still in flight there. If MEMBAR.ALL.CTA
// waits for it, every tile stalls until its successor's page has arrived from DRAM, and the double-buffered copy
// overlaps only the score product. Per iteration of a CTA (cycles, clock64 of thread 0, median over CTAs and
// iterations), with W = a dependent LOP3 chain about as long as the copy's latency:
//   copy       issue 16 KB of cp.async (cold lines), wait for them     (the latency)
//   work       W alone
//   copy+work  issue, W, wait                                           (~ max(copy, work): they overlap)
//   +fence     issue, the proxy fence, W, wait                          (~ copy + work if the fence waits)
// Build + run (sm_90a):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/mbc benchmarks/micro/membar_cpasync.cu && /tmp/mbc
#include <cstdio>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

constexpr int kThreads = 128, kBytes = 16384, kIters = 64;

__device__ __forceinline__ void copy_page(uint32_t dst, const uint8_t* src) {  // 16 KB: 8 x 16 B per thread
#pragma unroll
  for (int i = 0; i < kBytes / (16 * kThreads); ++i) {
    const int off = (i * kThreads + threadIdx.x) * 16;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + off), "l"(src + off) : "memory");
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

constexpr int kWork = 384;  // dependent LOP3: ~4 cycles each

// MODE 0: copy, 1: work, 2: copy+work, 3: +fence; out[cta * kIters + it] = cycles of one iteration (thread 0)
template <int MODE>
__global__ void __launch_bounds__(kThreads) k(const uint8_t* src, size_t stride, long long* out) {
  __shared__ __align__(128) uint8_t page[kBytes];
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(page);
  uint32_t x = threadIdx.x * 0x9E3779B9u;
  for (int it = 0; it < kIters; ++it) {
    const uint8_t* s = src + ((size_t)it * gridDim.x + blockIdx.x) * stride;  // every (CTA, iteration): new lines
    __syncthreads();
    const long long t0 = clock64();
    if (MODE != 1) copy_page(dst, s);
    if (MODE == 3) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if (MODE != 0) {
#pragma unroll 16
      for (int i = 0; i < kWork; ++i) asm volatile("lop3.b32 %0, %0, %1, %0, 0x96;\n" : "+r"(x) : "r"(i));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    const long long t1 = clock64() + (x & 0);  // (x & 0: still 0, after the chain in program order)
    if (threadIdx.x == 0) out[blockIdx.x * kIters + it] = t1 - t0;
  }
  if (x == 0x12345u) out[0] = -1;  // keep the chain
}

template <int MODE>
double median_cycles(const uint8_t* src, size_t stride, long long* out, int ctas) {
  k<MODE><<<ctas, kThreads>>>(src, stride, out);
  std::vector<long long> h(ctas * kIters);
  cudaMemcpy(h.data(), out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  if (cudaGetLastError() != cudaSuccess) return -1.0;
  std::sort(h.begin(), h.end());
  return (double)h[h.size() / 2];
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int ctas = 2 * sms;  // two CTAs per SM, as the decode kernel
  const size_t stride = kBytes, total = stride * ctas * kIters * 4;  // 4 modes x fresh lines each (no L2 reuse)
  uint8_t* src;
  long long* out;
  cudaMalloc(&src, total);
  cudaMemset(src, 1, total);
  cudaMalloc(&out, ctas * kIters * sizeof(long long));
  const size_t part = stride * ctas * kIters;
  const double copy = median_cycles<0>(src, stride, out, ctas);
  const double work = median_cycles<1>(src + part, stride, out, ctas);
  const double both = median_cycles<2>(src + 2 * part, stride, out, ctas);
  const double fenced = median_cycles<3>(src + 3 * part, stride, out, ctas);
  printf("%d CTAs of %d threads, %d KB of cp.async each; median cycles per iteration of:\n", ctas, kThreads,
         kBytes / 1024);
  printf("copy %8.0f  work %8.0f  copy+work %8.0f  +fence %8.0f\n", copy, work, both, fenced);
  printf("the proxy fence %s for the copies in flight (+fence - copy+work = %.0f cycles)\n",
         fenced - both > 0.5 * (copy < work ? copy : work) ? "WAITS" : "does not wait", fenced - both);
  return 0;
}
