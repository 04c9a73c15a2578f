// Checks, on an sm_90 GPU, the conventions the swap-AB decode kernel (src/quantmla/kernels/csrc/decode_mla_sm90.cu)
// builds on, one wgmma at a time, against exact integer products computed on the host: the register A fragment,
// the K-major no-swizzle B layout with its descriptor (leading / stride byte offsets 128 / 256), the accumulator
// fragment, fp16 and bf16, a k-block further on through Desc::at, and several batches in flight with wgmma_wait<1>.
// If a check fails it also tries the descriptor with the two byte offsets swapped and says which one matches.
//
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/quantmla/kernels/csrc \
//        -o /tmp/wgmma_check benchmarks/micro/wgmma_layout_check.cu && /tmp/wgmma_check
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "mla_ops.cuh"
#include "mla_wgmma.cuh"

using namespace qmla;

// small integers: every product and sum is exact in fp32, fp16 and bf16
__host__ __device__ inline int a_val(int m, int k, int kb) { return ((m * 7 + k * 3 + kb * 5) % 9) - 4; }
__host__ __device__ inline int b_val(int k, int n, int kb) { return ((k * 5 + n * 11 + kb * 3) % 7) - 3; }

template <bool BF16>
__device__ inline uint32_t pack2(int lo, int hi) {
  if (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn((float)lo, (float)hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __half2 v = __floats2half2_rn((float)lo, (float)hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// D[64 x 16] = sum over NKB k-blocks of A_kb[64 x 16] B_kb[16 x 16]; lbo/sbo: the descriptor's byte offsets
template <bool BF16, int NKB>
__global__ void check_kernel(float* out, uint32_t lbo, uint32_t sbo) {
  __shared__ __align__(128) uint8_t bs[NKB * 512];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < NKB * 256; i += 128) {  // element (k, n) of k-block kb at kblock_offset
    const int kb = i / 256, k = (i / 16) % 16, n = i % 16;
    const float v = (float)b_val(k, n, kb);
    if (BF16)
      *reinterpret_cast<__nv_bfloat16*>(bs + kb * 512 + kblock_offset(k, n)) = __float2bfloat16_rn(v);
    else
      *reinterpret_cast<__half*>(bs + kb * 512 + kblock_offset(k, n)) = __float2half_rn(v);
  }
  fence_proxy_async();
  __syncthreads();
  const Desc desc(wgmma_desc(smem_u32(bs), lbo, sbo));
  float d[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) d[i] = 0.f;
  fence_operands(d);
  const int r0 = 16 * warp + g;
#pragma unroll
  for (int kb = 0; kb < NKB; ++kb) {
    uint32_t a[4];
    a[0] = pack2<BF16>(a_val(r0, 2 * t, kb), a_val(r0, 2 * t + 1, kb));
    a[1] = pack2<BF16>(a_val(r0 + 8, 2 * t, kb), a_val(r0 + 8, 2 * t + 1, kb));
    a[2] = pack2<BF16>(a_val(r0, 2 * t + 8, kb), a_val(r0, 2 * t + 9, kb));
    a[3] = pack2<BF16>(a_val(r0 + 8, 2 * t + 8, kb), a_val(r0 + 8, 2 * t + 9, kb));
    wgmma_fence();
    if (BF16)
      wgmma_bf16_n16(d, a, desc.at(kb * 512), desc.hi);
    else
      wgmma_f16_n16(d, a, desc.at(kb * 512), desc.hi);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  fence_operands(d);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1)
#pragma unroll
      for (int v0 = 0; v0 < 2; ++v0) out[(r0 + 8 * v1) * 16 + 8 * j + 2 * t + v0] = d[4 * j + v0 + 2 * v1];
}

template <bool BF16, int NKB>
static int run(const char* name, uint32_t lbo, uint32_t sbo, bool quiet = false) {
  float* dev;
  float host[64 * 16];
  cudaMalloc(&dev, sizeof(host));
  cudaMemset(dev, 0xFF, sizeof(host));
  check_kernel<BF16, NKB><<<1, 128>>>(dev, lbo, sbo);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("%-28s CUDA error: %s\n", name, cudaGetErrorString(e));
    return 1;
  }
  cudaMemcpy(host, dev, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  int bad = 0;
  double worst = 0.0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 16; ++n) {
      double want = 0.0;
      for (int kb = 0; kb < NKB; ++kb)
        for (int k = 0; k < 16; ++k) want += (double)a_val(m, k, kb) * b_val(k, n, kb);
      const double err = host[m * 16 + n] - want;
      if (err != 0.0) ++bad;
      if (err * err > worst * worst) worst = err;
    }
  if (!quiet) printf("%-28s lbo %3u sbo %3u: %s (%d of 1024 wrong, worst %g)\n", name, lbo, sbo, bad ? "FAIL" : "OK",
                     bad, worst);
  return bad ? 1 : 0;
}

int main() {
  int dev_major = 0, dev_minor = 0;
  cudaDeviceGetAttribute(&dev_major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&dev_minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (dev_major != 9 || dev_minor != 0) {
    printf("needs an sm_90 GPU (found sm_%d%d)\n", dev_major, dev_minor);
    return 2;
  }
  int fails = 0;
  fails += run<false, 1>("fp16, one k-block", 128, 256);
  fails += run<true, 1>("bf16, one k-block", 128, 256);
  fails += run<false, 9>("fp16, 9 k-blocks in flight", 128, 256);
  fails += run<true, 4>("bf16, 4 k-blocks in flight", 128, 256);
  if (fails) {
    printf("swapped byte offsets: ");
    printf("%s\n", run<false, 1>("fp16 swapped", 256, 128, true) == 0 ? "fp16 MATCHES with lbo 256 / sbo 128"
                                                                       : "no match either");
  }
  printf("%s\n", fails ? "wgmma conventions: FAIL" : "wgmma conventions: OK");
  return fails ? 1 : 0;
}
