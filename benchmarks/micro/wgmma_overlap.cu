// Do register-A wgmma and ordinary ALU work overlap on an SM? The decode kernel's main loop (decode_mla_sm90.cu)
// interleaves m64n16k16 products whose A operand is in registers (the unpacked codes) with ~6 LOP3 / SHF per product,
// and a second CTA per SM bought it no throughput (docs/kernels.md, "Is occupancy the lever?"). If a register-A
// product holds the register file (or the issue port) while the tensor core reads its operand, the ALU work waits
// for it and the two add up; with A in shared memory (SS) they should not. Per SM, with 1 and 2 CTAs (one warpgroup
// each), cycles per batch of 4 chained m64n16k16 products (as the kernel's k-loop), for:
//   rs      A in registers, nothing else          ss      A in shared memory, nothing else
//   alu     K LOP3 per batch (8 independent chains per thread, values never enter a product), no products
//   rs+alu  both interleaved in one warp           ss+alu  both interleaved
// overlap = (t(x) + t(alu) - t(x+alu)) / min(t(x), t(alu)): 1 = the smaller hides completely under the larger, 0 =
// they add up. Then the same work split across two warpgroups of one CTA (one CTA per SM; session 31): warpgroup 0
// only products, warpgroup 1 only the LOP3 -- a ping-pong design's question (FlashAttention-3's: one warpgroup's
// softmax under the other's products): do the tensor pipe and the ALUs overlap when different warps feed them?
// Build + run (sm_90a):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgo benchmarks/micro/wgmma_overlap.cu && /tmp/wgo
#include <cstdio>
#include <cuda_runtime.h>
#include <stdint.h>

#define R8(x) "+f"(x[0]), "+f"(x[1]), "+f"(x[2]), "+f"(x[3]), "+f"(x[4]), "+f"(x[5]), "+f"(x[6]), "+f"(x[7])

__device__ __forceinline__ void mma_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : R8(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
__device__ __forceinline__ void mma_ss(float (&d)[8], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : R8(d)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {  // a ^ b ^ c, kept (volatile)
  uint32_t r;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ uint64_t desc_of(uint32_t addr) {  // K-major, no swizzle, LBO 128, SBO 256
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

enum Mode { RS = 0, SS = 1, ALU = 2, RS_ALU = 3, SS_ALU = 4 };

// Every kernel's start: B (and SS's A) in shared memory, fp16 values near 1, their descriptors; accumulators, the
// register A operand and the LOP3 chains' values in registers.
__device__ __forceinline__ void setup(uint16_t* b, uint64_t& db, uint64_t& da, float (&d)[8], uint32_t (&a)[4],
                                      uint32_t (&x)[8]) {
  for (int i = threadIdx.x; i < 16 * 256; i += blockDim.x) b[i] = 0x3C00 ^ (i & 7);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(b);
  db = desc_of(base);
  da = desc_of(base + 4096);
  for (int i = 0; i < 8; ++i) d[i] = 0.f;
  a[0] = 0x3C003C00u ^ threadIdx.x;
  a[1] = 0x3C003C00u;
  a[2] = 0x3C003C01u;
  a[3] = 0x3C003C02u;
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x * 0x9E3779B9u + i;
}

// One batch: four chained m64n16k16 (A in registers, or in shared memory with SS), each followed by KA / 4 LOP3 of
// the ALU chains (KA = 0: none), then commit and wait until one batch is in flight.
template <bool SS, int KA>
__device__ __forceinline__ void batch(float (&d)[8], const uint32_t (&a)[4], uint64_t da, uint64_t db,
                                      uint32_t (&x)[8]) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (SS)
      mma_ss(d, da, db);
    else
      mma_rs(d, a, db);
#pragma unroll
    for (int i = 0; i < KA / 4; ++i) x[i % 8] = lop3(x[i % 8], x[(i + 1) % 8], x[(i + 3) % 8]);  // behind it
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

template <int K>
__device__ __forceinline__ void chains(uint32_t (&x)[8]) {  // K LOP3 in 8 independent chains
#pragma unroll
  for (int i = 0; i < K; ++i) x[i % 8] = lop3(x[i % 8], x[(i + 1) % 8], x[(i + 3) % 8]);
}

__device__ __forceinline__ void finish(float* out, const float (&d)[8], const uint32_t (&x)[8]) {  // keep all
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += d[i] + (float)(x[i] & 1);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int MODE, int K>
__global__ void __launch_bounds__(128) k(float* out, int iters) {
  __shared__ __align__(128) uint16_t b[16 * 256];  // B: 16 x 16 (and room); A (SS): 64 x 16 at b + 2048
  uint64_t db, da;
  float d[8];
  uint32_t a[4], x[8];
  setup(b, db, da, d, a, x);
  constexpr bool kSs = MODE == SS || MODE == SS_ALU;
  for (int it = 0; it < iters; ++it) {
    if constexpr (MODE == ALU)
      chains<K>(x);
    else
      batch<kSs, MODE >= ALU ? K : 0>(d, a, da, db, x);
  }
  finish(out, d, x);
}

// Two warpgroups, one CTA: warpgroup 0 issues the products (A in registers: RS, or shared memory: SS), warpgroup 1
// the ALU chains (SPLIT_*); or, for the baselines, one warpgroup's share alone with the other idle (WG0_RS / WG0_SS:
// the products, WG1_ALU: the ALU work).
enum Split { SPLIT_RS = 0, SPLIT_SS = 1, WG0_RS = 2, WG0_SS = 3, WG1_ALU = 4 };

template <int SPLIT, int K>
__global__ void __launch_bounds__(256) k_split(float* out, int iters) {
  __shared__ __align__(128) uint16_t b[16 * 256];
  uint64_t db, da;
  float d[8];
  uint32_t a[4], x[8];
  setup(b, db, da, d, a, x);
  const int wg = threadIdx.x / 128;
  const bool mma = wg == 0 && SPLIT != WG1_ALU;
  const bool alu = wg == 1 && (SPLIT == SPLIT_RS || SPLIT == SPLIT_SS || SPLIT == WG1_ALU);
  if (mma)
    for (int it = 0; it < iters; ++it) batch<SPLIT == SPLIT_SS || SPLIT == WG0_SS, 0>(d, a, da, db, x);
  else if (alu)
    for (int it = 0; it < iters; ++it) chains<K>(x);
  finish(out, d, x);
}

template <int SPLIT, int K>
double cycles_split(float* out, int sms, double ghz) {  // one CTA of two warpgroups per SM
  const int iters = 4096;
  k_split<SPLIT, K><<<sms, 256>>>(out, 16);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k_split<SPLIT, K><<<sms, 256>>>(out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  if (cudaGetLastError() != cudaSuccess) return -1.0;
  return ms * 1e-3 * ghz * 1e9 / iters;
}

template <int K>
void split_row(float* out, int sms, double ghz) {
  const double rs = cycles_split<WG0_RS, K>(out, sms, ghz), ss = cycles_split<WG0_SS, K>(out, sms, ghz);
  const double alu = cycles_split<WG1_ALU, K>(out, sms, ghz);
  const double rsa = cycles_split<SPLIT_RS, K>(out, sms, ghz), ssa = cycles_split<SPLIT_SS, K>(out, sms, ghz);
  auto ov = [](double x, double y, double xy) { return (x + y - xy) / (x < y ? x : y); };
  printf("split WGs  LOP3/batch %3d | rs %7.1f  ss %7.1f  alu %7.1f | rs||alu %7.1f (overlap %5.2f)  ss||alu %7.1f "
         "(overlap %5.2f)\n",
         K, rs, ss, alu, rsa, ov(rs, alu, rsa), ssa, ov(ss, alu, ssa));
}

template <int MODE, int K>
double cycles_per_batch(float* out, int sms, int ctas, double ghz) {
  const int iters = 4096;
  k<MODE, K><<<sms * ctas, 128>>>(out, 16);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<MODE, K><<<sms * ctas, 128>>>(out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  if (cudaGetLastError() != cudaSuccess) return -1.0;
  return ms * 1e-3 * ghz * 1e9 / ((double)ctas * iters);  // batches (of one CTA) per SM
}

template <int K>
void row(float* out, int sms, int ctas, double ghz) {
  const double rs = cycles_per_batch<RS, K>(out, sms, ctas, ghz), ss = cycles_per_batch<SS, K>(out, sms, ctas, ghz);
  const double alu = cycles_per_batch<ALU, K>(out, sms, ctas, ghz);
  const double rsa = cycles_per_batch<RS_ALU, K>(out, sms, ctas, ghz);
  const double ssa = cycles_per_batch<SS_ALU, K>(out, sms, ctas, ghz);
  auto ov = [](double x, double y, double xy) { return (x + y - xy) / (x < y ? x : y); };
  printf("CTAs/SM %d  LOP3/batch %3d | rs %7.1f  ss %7.1f  alu %7.1f | rs+alu %7.1f (overlap %5.2f)  ss+alu %7.1f "
         "(overlap %5.2f)\n",
         ctas, K, rs, ss, alu, rsa, ov(rs, alu, rsa), ssa, ov(ss, alu, ssa));
}

int main() {
  int sms, clk;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  const double ghz = clk / 1e6;
  float* out;
  cudaMalloc(&out, sms * 2 * 128 * 4);
  printf("%d SMs, %.2f GHz; cycles per SM per batch of 4 m64n16k16 (one CTA's batch; with 2 CTAs per SM both run)\n",
         sms, ghz);
  for (int ctas = 1; ctas <= 2; ++ctas) {
    row<8>(out, sms, ctas, ghz);
    row<24>(out, sms, ctas, ghz);  // ~ the decode kernel's ratio: ~400 unpacking LOP3 / SHF per 68 products
    row<64>(out, sms, ctas, ghz);
  }
  printf("two warpgroups in one CTA per SM, warpgroup 0 the products, warpgroup 1 the LOP3 "
         "(cycles per SM per batch)\n");
  cudaFree(out);
  cudaMalloc(&out, sms * 256 * 4);
  split_row<8>(out, sms, ghz);
  split_row<24>(out, sms, ghz);
  split_row<64>(out, sms, ghz);
  return 0;
}
