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
#include <stdint.h>

#include "micro_device.cuh"

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

// One product of type T: fp16 (m64nNk16, fp32 accumulators) or s8 (m64nNk32, s32 accumulators).
struct F16 {
  using Acc = float;
  static constexpr int K = 16;
  static constexpr uint16_t B_BITS = 0x3C00;                  // fp16 values near 1
  static constexpr uint32_t A_BITS[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C01u, 0x3C003C02u};
  template <int N>
  __device__ static void mma(Acc (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) { ::mma<N>(d, a, desc); }
};
struct S8 {  // B is N x 32 int8: the same bytes per row as N x 16 fp16 (one K-major core matrix is 8 rows x 16 B)
  using Acc = int;
  static constexpr int K = 32;
  static constexpr uint16_t B_BITS = 0x0101;                  // small int8 values
  static constexpr uint32_t A_BITS[4] = {0x01010101u, 0x01020304u, 0x05060708u, 0x07070707u};
  template <int N>
  __device__ static void mma(Acc (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) { mma_s8<N>(d, a, desc); }
};

template <class T, int N, int BATCH, bool CHAIN>
__global__ void __launch_bounds__(128) k(float* out, int iters) {
  __shared__ __align__(128) uint16_t b[16 * 256];
  for (int i = threadIdx.x; i < 16 * 256; i += 128) b[i] = T::B_BITS ^ (i & 7);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = desc_of((uint32_t)__cvta_generic_to_shared(b));
  constexpr int NA = CHAIN ? 1 : BATCH;
  typename T::Acc d[NA][N / 2];
  for (int j = 0; j < NA; ++j)
    for (int i = 0; i < N / 2; ++i) d[j][i] = 0;
  uint32_t a[4] = {T::A_BITS[0] ^ threadIdx.x, T::A_BITS[1], T::A_BITS[2], T::A_BITS[3]};
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < BATCH; ++j) T::template mma<N>(d[CHAIN ? 0 : j], a, desc);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
  for (int j = 0; j < NA; ++j)
    for (int i = 0; i < N / 2; ++i) s += (float)d[j][i];
  out[blockIdx.x * 128 + threadIdx.x] = s;
}

template <class T, int N, int BATCH, bool CHAIN>
void time_one(const MicroDevice& dev, int ctas) {
  const int iters = 2048;
  const double cycles = best_cycles(dev, [&] { k<T, N, BATCH, CHAIN><<<dev.sms * ctas, 128>>>(dev.out, iters); }, 1);
  const double per_sm = (double)ctas * iters * BATCH;  // wgmma (warpgroup instructions) per SM
  const double ops = per_sm * dev.sms * 2.0 * 64 * N * T::K;
  printf("%s N %3d k%d  %s x%d  CTAs/SM %d: %6.1f cycles per wgmma per SM, %6.0f T%s/s (%s)\n",
         T::K == 16 ? "f16" : "s8 ", N, T::K, CHAIN ? "chain " : "indep.", BATCH, ctas, cycles / per_sm,
         ops / (cycles / (dev.ghz * 1e9)) / 1e12, T::K == 16 ? "FLOP" : "OP", cudaGetErrorString(cudaGetLastError()));
}

int main() {
  const MicroDevice dev = micro_device(4 * 128);
  printf("%d SMs, max clock %.2f GHz; dense fp16 peak = 8 cycles per m64n16k16 per SM (4,096 FLOP/clock)\n",
         dev.sms, dev.ghz);
  for (int ctas = 1; ctas <= 2; ++ctas) {
    time_one<F16, 16, 4, true>(dev, ctas);
    time_one<F16, 16, 8, true>(dev, ctas);
    time_one<F16, 16, 4, false>(dev, ctas);
    time_one<F16, 32, 4, true>(dev, ctas);
    time_one<F16, 32, 4, false>(dev, ctas);
    time_one<F16, 64, 4, true>(dev, ctas);
    time_one<F16, 64, 2, false>(dev, ctas);
    time_one<S8, 16, 4, true>(dev, ctas);
    time_one<S8, 16, 4, false>(dev, ctas);
    time_one<S8, 32, 4, true>(dev, ctas);
    time_one<S8, 32, 4, false>(dev, ctas);
  }
  return 0;
}
