// Issue 9, many heads: what do the hm kernel's products cost for the way their operands sit in shared memory?
// The hm timing skeleton (hm_tile.cu, session 36) gave 1,920 SM cycles per 64-token tile for the score products alone
// (36 m64n64k16 with q and the tile both in shared memory: ~53 cycles each where the peak is 32 and a product with A
// in registers takes 37, wgmma_rate.cu), so the score product runs at ~60% of the tensor rate. Is that the operand
// layout (hm stores q and the tiles without swizzle: CUTLASS's INTERLEAVE canonical layout, 8 x 8 core matrices of
// 128 contiguous bytes) or the two shared-memory operands as such? One CTA per SM, two consumer warpgroups (hm's),
// each running its products over its own 64 x 576 fp16 tile (+ the shared q) as one iteration of hm would, plus
// optionally a third warpgroup storing 16-byte rows into the tiles at full speed (hm's producer writes 72 KB a tile):
//   score  SS : S[64 heads x 64 tok] += q[64 x 16] . tile^T, both K-major in shared memory (hm today), 36 per tile
//   score  RS : S^T[64 tok x 64 heads] += tile[64 x 16] (ldmatrix.x4 into registers) . q^T (swap-AB), 36 per tile
//   output RS : O[64 x 256] += P[64 x 16] (registers) . V[16 tok x 256 ch] (the tile MN-major), 8 per iteration
// each with the operands in the INTERLEAVE layout (none) and in the 128-byte swizzle (sw128: rows of 128 bytes, 16-byte
// chunk j of row r at chunk j ^ (r % 8), 8-row atoms of 1 KB: FlashMLA's and TMA's layout). The data are constant
// fp16 values (timing only; nothing is checked). Prints SM cycles per 64-token tile and per product.
// Build + run (sm_90a):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I src/quantmla/kernels/csrc -o /tmp/sor \
//     benchmarks/micro/smem_operand_rate.cu && /tmp/sor
// (the products, fences and ldmatrix are the hm kernel's own: mla_hm.cuh, mla_wgmma.cuh, mla_ops.cuh)
#include <stdint.h>

#include "micro_device.cuh"
#include "mla_hm.cuh"
#include "mla_wgmma.cuh"

namespace {

constexpr int kTileBytes = 73728;  // 64 rows x 576 fp16
constexpr int kQ = 0, kT0 = kTileBytes, kT1 = 2 * kTileBytes, kSmem = 3 * kTileBytes;

enum Form { SCORE_SS = 0, SCORE_RS = 1, OUTPUT_RS = 2, BOTH = 3 };

using qmla::smem_u32;
// sm_90 matrix descriptor (mla_wgmma.cuh's) with the layout type: 0 none, 1 the 128-byte swizzle (bits 62-63)
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo, int sw128) {
  return qmla::wgmma_desc(addr, lbo, sbo) | ((uint64_t)(sw128 ? 1 : 0) << 62);
}
// the byte offset of (row, channel) of a 64-row fp16 operand: none = channel-octet-major core matrices (hm's);
// sw128 = 9 blocks of 64 channels, each 64 rows x 128 bytes, chunks XOR-swizzled by row % 8
__device__ __forceinline__ uint32_t at(int row, int ch, int sw128) {
  if (!sw128) return qmla::hm::oct_offset(row, ch);
  return (ch >> 6) * 8192 + row * 128 + ((((ch >> 3) & 7) ^ (row & 7)) << 4) + (ch & 7) * 2;
}
// K-major descriptor of k-step kk (16 channels) of a 64-row operand at base
__device__ __forceinline__ uint64_t kdesc(uint32_t base, int kk, int sw128) {
  if (!sw128) return desc(base + kk * 2048, 1024, 128, 0);
  return desc(base + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024, 1);
}
// MN-major descriptor of the tile as V (k = 16 tokens from 16 kt, n = 256 channels from 256 nh)
__device__ __forceinline__ uint64_t vdesc(uint32_t base, int kt, int nh, int sw128) {
  if (!sw128) return desc(base + nh * 32 * 1024 + kt * 256, 128, 1024, 0);
  return desc(base + nh * 4 * 8192 + kt * 2048, 8192, 1024, 1);
}

#define F8(x, o) "+f"(x[o]), "+f"(x[o + 1]), "+f"(x[o + 2]), "+f"(x[o + 3]), "+f"(x[o + 4]), "+f"(x[o + 5]), \
                 "+f"(x[o + 6]), "+f"(x[o + 7])

// S^T[64 tok x 64 heads] += A[64 x 16] (registers) . B (shared memory, K-major): the swap-AB score form (no hm helper)
__device__ __forceinline__ void rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
               "%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, "
               "%36, 1, 1, 1, 0;\n"
               : F8(d, 0), F8(d, 8), F8(d, 16), F8(d, 24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
               : "memory");
}
__device__ __forceinline__ void ss_n64(float (&d)[32], uint64_t a, uint64_t b) {  // hm's score product
  qmla::hm::wgmma_ss_n64(d, (uint32_t)a, (uint32_t)(a >> 32), (uint32_t)b, (uint32_t)(b >> 32), 1);
}
__device__ __forceinline__ void rs_n256_t(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {  // hm's output
  qmla::hm::wgmma_rs_n256_t(d, a, (uint32_t)b, (uint32_t)(b >> 32));
}
__device__ __forceinline__ void fence() { qmla::wgmma_fence(); }
__device__ __forceinline__ void commit() { qmla::wgmma_commit(); }
__device__ __forceinline__ void wait0() { qmla::wgmma_wait<0>(); }
__device__ __forceinline__ void ldm_x4(uint32_t (&a)[4], uint32_t addr) { qmla::ldsm_x4(a[0], a[1], a[2], a[3], addr); }

template <int FORM, int SW>
__device__ __forceinline__ float consumer(uint32_t s0, int c, int iters, int lt) {
  const int warp = lt >> 5, lane = lt & 31;
  const uint32_t tile = s0 + (c ? kT1 : kT0), q = s0 + kQ;
  float s[32], o[128];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  // swap-AB A fragments: lane's row of matrix lane / 8 (rows 0-7 / 8-15 of the warp's 16, channels 0-7 / 8-15)
  const int mat = lane >> 3, arow = 16 * warp + (mat & 1) * 8 + (lane & 7), ach = (mat >> 1) * 8;
  uint32_t p[4] = {0x3C003C00u ^ (uint32_t)lt, 0x3C003C00u, 0x3C003C01u, 0x3C003C02u};  // "P" fragments
  for (int it = 0; it < iters; ++it) {
    if constexpr (FORM == SCORE_SS || FORM == BOTH) {
      fence();
#pragma unroll
      for (int kk = 0; kk < 36; ++kk) ss_n64(s, kdesc(q, kk, SW), kdesc(tile, kk, SW));
      commit();
      wait0();
    }
    if constexpr (FORM == SCORE_RS) {
#pragma unroll
      for (int k0 = 0; k0 < 36; k0 += 4) {  // a batch of 4 k-steps: their fragments loaded, one fence, 4 products
        uint32_t a[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldm_x4(a[kk], tile + at(arow, 16 * (k0 + kk) + ach, SW));
        fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) rs_n64(s, a[kk], kdesc(q, k0 + kk, SW));
      }
      commit();
      wait0();
    }
    if constexpr (FORM == OUTPUT_RS || FORM == BOTH) {  // both tiles of the iteration, the consumer's 256 channels
      fence();
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int kt = 0; kt < 4; ++kt) rs_n256_t(o, p, vdesc(t ? s0 + kT1 : s0 + kT0, kt, c, SW));
      commit();
      wait0();
    }
    p[0] ^= __float_as_uint(s[0] + s[31]) & 1u;  // a data dependence between iterations (as the softmax makes one)
  }
  float keep = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) keep += s[i];
#pragma unroll
  for (int i = 0; i < 128; ++i) keep += o[i];
  return keep;
}

// PRODUCER: WG 0 stores 16-byte rows into both tiles, `iters` x 2 tiles' worth (72 KB each), as fast as it can
template <int FORM, int SW, bool PRODUCER, bool CONSUMERS>
__global__ void __launch_bounds__(384, 1) k(int iters, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, lt = tid & 127;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const uint32_t s0 = smem_u32(smem);
  for (int i = tid; i < kSmem / 16; i += 384)  // fp16 values near 1 (no NaN / denormal timing)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0x3C003C00u ^ (i & 7), 0x40003C00u, 0x3C004000u, 0x3C003C00u);
  qmla::fence_proxy_async();
  __syncthreads();
  float keep = 0.f;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 80;\n");
    if constexpr (PRODUCER) {
      const uint32_t v = 0x3C003C00u ^ (uint32_t)lt;
      for (int it = 0; it < iters; ++it)
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll 4
          for (int i = 0; i < 36; ++i)  // 4,608 rows of 16 bytes = one 64 x 576 tile over 128 threads
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(s0 + (t ? kT1 : kT0) +
                                                                             ((i * 128 + lt) * 16) % kTileBytes),
                         "r"(v)
                         : "memory");
      qmla::fence_proxy_async();
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n");
    if constexpr (CONSUMERS) keep = consumer<FORM, SW>(s0, wg - 1, iters, lt);
  }
  out[blockIdx.x * 384 + tid] = keep;
}

template <int FORM, int SW, bool PRODUCER, bool CONSUMERS>
double run(const MicroDevice& dev, int iters, const char* what) {
  cudaFuncSetAttribute(k<FORM, SW, PRODUCER, CONSUMERS>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const double cyc =
      best_cycles(dev, [&] { k<FORM, SW, PRODUCER, CONSUMERS><<<dev.sms, 384, kSmem>>>(iters, dev.out); }, 5);
  const double per_tile = cyc / (2.0 * iters);  // an iteration covers two 64-token tiles (one per consumer)
  // per tile: 36 score products (one consumer's own tile), 8 output products (each consumer 4 over every tile)
  const int products = FORM == SCORE_SS || FORM == SCORE_RS ? 36 : FORM == OUTPUT_RS ? 8 : 44;
  printf("%-44s %-6s %s %7.0f cycles per tile, %5.1f per product  %s\n", what, SW ? "sw128" : "none",
         PRODUCER ? (CONSUMERS ? "+ stores" : "stores  ") : "        ", per_tile,
         CONSUMERS ? per_tile / products : 0.0, cudaGetErrorString(cudaGetLastError()));
  return per_tile;
}

template <int FORM>
void forms(const MicroDevice& dev, int iters, const char* what) {
  run<FORM, 0, false, true>(dev, iters, what);
  run<FORM, 1, false, true>(dev, iters, what);
  run<FORM, 0, true, true>(dev, iters, what);
  run<FORM, 1, true, true>(dev, iters, what);
}

}  // namespace

int main() {
  const MicroDevice dev = micro_device(384);
  const int iters = 512;
  printf("%d SMs, %.2f GHz; peak: 32 cycles per m64n64k16, 128 per m64n256k16 (2,048 fp16 FMA a cycle per SM)\n",
         dev.sms, dev.ghz);
  run<SCORE_SS, 0, true, false>(dev, iters, "producer stores alone (72 KB a tile)");
  forms<SCORE_SS>(dev, iters, "score SS (q . tile^T, hm today: none)");
  forms<SCORE_RS>(dev, iters, "score RS (tile by ldmatrix . q^T, swap-AB)");
  forms<OUTPUT_RS>(dev, iters, "output RS (P . V, tile MN-major)");
  forms<BOTH>(dev, iters, "score SS + output RS (hm's products)");
  return 0;
}
