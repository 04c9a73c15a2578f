// Throughput of mma.sync m16n8k16 (bf16 in, fp32 accumulate) on the current GPU: 8 independent accumulators per
// warp, ITERS iterations; prints TFLOP/s and cycles per HMMA per SM sub-partition. Build + run:
//   nvcc -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/mma mma_sync_rate.cu && /tmp/mma
#include <cstdio>
#include <cuda_runtime.h>
#include <stdint.h>
__global__ void k(float* out, int iters, uint32_t seed) {
  float d[8][4] = {};
  uint32_t a0 = seed ^ threadIdx.x, a1 = a0 * 3, a2 = a0 * 5, a3 = a0 * 7, b0 = a0 * 11, b1 = a0 * 13;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  float s = 0;
  for (int j = 0; j < 8; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  float* out; cudaMalloc(&out, sms * 8 * 1024 * 4);
  const int iters = 4096;
  for (int warps = 4; warps <= 16; warps *= 2) {
    k<<<sms * 2, 32 * warps>>>(out, 16, 1);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaEventRecord(e0);
    k<<<sms * 2, 32 * warps>>>(out, iters, 1);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    double hmma = (double)sms * 2 * warps * iters * 8;  // warp-level HMMA instructions
    double flops = hmma * 2 * 16 * 8 * 16;
    printf("warps/SM %2d: %.0f TFLOP/s, %.2f cycles per HMMA per SMSP (at %.2f GHz max clock)\n", 2 * warps,
           flops / ms / 1e9, (ms * 1e-3) * clk * 1e3 * 4 / (hmma / sms), clk / 1e6);
  }
  return 0;
}
