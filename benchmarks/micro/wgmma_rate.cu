// Throughput of wgmma m64nNk16 (fp16 in, fp32 accumulate) with A in registers and B in shared memory, for the N
// the decode kernels use (16 heads) and wider: is a 16-wide product as cheap per instruction as its FLOPs say?
// One warpgroup per CTA, CTAS CTAs per SM (the decode kernel runs 2), ITERS batches; a batch is BATCH products,
// either chained into one accumulator (as a k-loop: the decode kernel's score and output products) or into BATCH
// independent accumulators, committed, then wgmma.wait_group 1 (one batch in flight while the next is issued).
// Also the 8-bit integer products (m64nNk32 s8 x s8 -> s32, A in registers: the same 2 KB of A per instruction as
// m64n16k16 fp16, twice the K): is a 4-bit code's product cheaper as s8 with N = 32 (a query split into two int8
// terms, hi and lo, side by side in B) than as fp16 with N = 16? (issue 9, session 34)
// Prints cycles per wgmma per SM and TFLOP/s (TOP/s for s8). Build + run (sm_90a):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgr benchmarks/micro/wgmma_rate.cu && /tmp/wgr
#include <cstdio>
#include <cuda_runtime.h>
#include <stdint.h>

#define R8(x, o) "+f"(x[o + 0]), "+f"(x[o + 1]), "+f"(x[o + 2]), "+f"(x[o + 3]), "+f"(x[o + 4]), "+f"(x[o + 5]), \
                 "+f"(x[o + 6]), "+f"(x[o + 7])

template <int N>
__device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);

template <>
__device__ __forceinline__ void mma<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, 1;\n"
               : R8(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void mma<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,"
               "%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 1;\n"
               : R8(d, 0), R8(d, 8) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void mma<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,"
               "%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, "
               "1, 1, 1, 1;\n"
               : R8(d, 0), R8(d, 8), R8(d, 16), R8(d, 24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

#define R8I(x, o) "+r"(x[o + 0]), "+r"(x[o + 1]), "+r"(x[o + 2]), "+r"(x[o + 3]), "+r"(x[o + 4]), "+r"(x[o + 5]), \
                  "+r"(x[o + 6]), "+r"(x[o + 7])

template <int N>
__device__ __forceinline__ void mma_s8(int (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);

template <>
__device__ __forceinline__ void mma_s8<16>(int (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1;\n"
               : R8I(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void mma_s8<32>(int (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,"
               "%14,%15}, {%16,%17,%18,%19}, %20, 1;\n"
               : R8I(d, 0), R8I(d, 8) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ uint64_t desc_of(uint32_t addr) {  // K-major, no swizzle, LBO 128, SBO 256
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

template <int N, int BATCH, bool CHAIN>
__global__ void __launch_bounds__(128) k(float* out, int iters) {
  __shared__ __align__(128) uint16_t b[16 * 256];
  for (int i = threadIdx.x; i < 16 * 256; i += 128) b[i] = 0x3C00 ^ (i & 7);  // fp16 values near 1
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = desc_of((uint32_t)__cvta_generic_to_shared(b));
  constexpr int NA = CHAIN ? 1 : BATCH;
  float d[NA][N / 2];
  for (int j = 0; j < NA; ++j)
    for (int i = 0; i < N / 2; ++i) d[j][i] = 0.f;
  uint32_t a[4] = {0x3C003C00u ^ threadIdx.x, 0x3C003C00u, 0x3C003C01u, 0x3C003C02u};
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < BATCH; ++j) mma<N>(d[CHAIN ? 0 : j], a, desc);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
  for (int j = 0; j < NA; ++j)
    for (int i = 0; i < N / 2; ++i) s += d[j][i];
  out[blockIdx.x * 128 + threadIdx.x] = s;
}

// The same loop with s8 products: B is N x 32 int8 = the same smem bytes per row as N x 16 fp16 (one K-major core
// matrix is 8 rows x 16 bytes for either type, so the descriptor is unchanged).
template <int N, int BATCH, bool CHAIN>
__global__ void __launch_bounds__(128) k8(float* out, int iters) {
  __shared__ __align__(128) uint16_t b[16 * 256];
  for (int i = threadIdx.x; i < 16 * 256; i += 128) b[i] = 0x0101 ^ (i & 7);  // small int8 values
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = desc_of((uint32_t)__cvta_generic_to_shared(b));
  constexpr int NA = CHAIN ? 1 : BATCH;
  int d[NA][N / 2];
  for (int j = 0; j < NA; ++j)
    for (int i = 0; i < N / 2; ++i) d[j][i] = 0;
  uint32_t a[4] = {0x01010101u ^ threadIdx.x, 0x01020304u, 0x05060708u, 0x07070707u};
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < BATCH; ++j) mma_s8<N>(d[CHAIN ? 0 : j], a, desc);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
  for (int j = 0; j < NA; ++j)
    for (int i = 0; i < N / 2; ++i) s += (float)d[j][i];
  out[blockIdx.x * 128 + threadIdx.x] = s;
}

template <int N, int BATCH, bool CHAIN>
void time_s8(float* out, int sms, int ctas, double clk_ghz) {
  const int iters = 2048;
  k8<N, BATCH, CHAIN><<<sms * ctas, 128>>>(out, 8);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k8<N, BATCH, CHAIN><<<sms * ctas, 128>>>(out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  const double per_sm = (double)ctas * iters * BATCH;
  const double ops = per_sm * sms * 2.0 * 64 * N * 32;
  printf("s8 N %3d k32  %s x%d  CTAs/SM %d: %6.1f cycles per wgmma per SM, %6.0f TOP/s (%s)\n", N,
         CHAIN ? "chain " : "indep.", BATCH, ctas, ms * 1e-3 * clk_ghz * 1e9 / per_sm, ops / (ms * 1e-3) / 1e12,
         cudaGetErrorString(cudaGetLastError()));
}

template <int N, int BATCH, bool CHAIN>
void time_one(float* out, int sms, int ctas, double clk_ghz) {
  const int iters = 2048;
  k<N, BATCH, CHAIN><<<sms * ctas, 128>>>(out, 8);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<N, BATCH, CHAIN><<<sms * ctas, 128>>>(out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  const double per_sm = (double)ctas * iters * BATCH;  // wgmma (warpgroup instructions) per SM
  const double flops = per_sm * sms * 2.0 * 64 * N * 16;
  printf("N %3d  %s x%d  CTAs/SM %d: %6.1f cycles per wgmma per SM, %6.0f TFLOP/s (%s)\n", N,
         CHAIN ? "chain " : "indep.", BATCH, ctas, ms * 1e-3 * clk_ghz * 1e9 / per_sm, flops / (ms * 1e-3) / 1e12,
         cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int sms, clk;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  const double ghz = clk / 1e6;
  float* out;
  cudaMalloc(&out, sms * 4 * 128 * 4);
  printf("%d SMs, max clock %.2f GHz; dense fp16 peak = 8 cycles per m64n16k16 per SM (4,096 FLOP/clock)\n", sms, ghz);
  for (int ctas = 1; ctas <= 2; ++ctas) {
    time_one<16, 4, true>(out, sms, ctas, ghz);
    time_one<16, 8, true>(out, sms, ctas, ghz);
    time_one<16, 4, false>(out, sms, ctas, ghz);
    time_one<32, 4, true>(out, sms, ctas, ghz);
    time_one<32, 4, false>(out, sms, ctas, ghz);
    time_one<64, 4, true>(out, sms, ctas, ghz);
    time_one<64, 2, false>(out, sms, ctas, ghz);
    time_s8<16, 4, true>(out, sms, ctas, ghz);
    time_s8<16, 4, false>(out, sms, ctas, ghz);
    time_s8<32, 4, true>(out, sms, ctas, ghz);
    time_s8<32, 4, false>(out, sms, ctas, ghz);
  }
  return 0;
}
