// Issue 9, many heads: is a heads-on-M, dequantize-once CTA fast enough to beat FlashMLA BF16 at 32-128 heads?
// A timing skeleton of the candidate design (docs/kernels.md "Many heads, heads on M with a producer warpgroup"),
// measured before anything is built: SM cycles per 64-token tile, one CTA of 64 heads per SM, three warpgroups:
//   WG 0, producer: per tile and buffer, waits `empty[b]`, reads the packed C4R4 page (19,712 B) from global memory
//         (a bulk L2 prefetch one tile ahead), turns it into exact bf16 codes with the unpacking's instruction mix
//         (PRMT, SHF, LOP3, HSUB2 per pair of codes) and stores the 64 x 576 tile (72 KB) into shared memory, one
//         quantization group at a time, arriving on `full[group][b]` after each;
//   WG 1 + c, consumers (c = 0, 1), FlashMLA's split: each iteration covers tiles 2k (WG 1's) and 2k + 1 (WG 2's);
//         a consumer computes the whole score product of its own tile, group by group as the groups land (36
//         m64n64k16 with q and the tile in shared memory, one accumulator folded into S per group), exchanges row
//         maxima, runs the softmax arithmetic, publishes its P (bf16, 8 KB) and takes the other's, then the output
//         product for its 256 channels over both tiles: 8 m64n128k16 with P in registers, 8 with P in shared
//         memory, the tile read MN-major. Then it arrives on `empty[b]` of both buffers.
// MODE bits take parts away (the timing is the point; the data are synthetic, the arithmetic is not checked):
//   1 score products, 2 output products, 4 the producer (without it the consumers never wait for data), 8 the
//   per-tile arithmetic and exchanges (folds, maxima, exp2, P pack and publish, two named barriers); 16 releases the
//   buffers group by group instead of whole (the producer refills RoPE, 0, 2, 1, 3 as the products free them, its
//   loads five steps ahead; the consumers read the groups in that order). Registers (setmaxnreg): producer 88,
//   consumers 208 (modes 23 / 31 spill ~50 bytes there).
// Build + run (sm_90a; prints cycles per tile and the ratio to FlashMLA BF16's measured per-tile time):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/hmt benchmarks/micro/hm_tile.cu && /tmp/hmt
#include <stdint.h>

#include "micro_device.cuh"

namespace {

constexpr int kQ = 0, kK0 = 73728, kK1 = 2 * 73728, kP = 3 * 73728, kMeta = kP + 8192, kBar = kMeta + 2560;
constexpr int kSmem = kBar + 8 * 22;  // full[5][2], empty[2], empty[5][2] (MODE 16)
// MODE 16: the order in which groups are freed, refilled and read: RoPE, 0, 2, 1, 3
__host__ __device__ constexpr int ord(int i) { return i == 0 ? 4 : i == 1 ? 0 : i == 2 ? 2 : i == 3 ? 1 : 3; }
constexpr int kPageBytes = 19712;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_init(uint32_t b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t b) {
  asm volatile("{\n.reg .b64 s;\nmbarrier.arrive.shared::cta.b64 s, [%0];\n}\n" ::"r"(b) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred r;\nHMW:\nmbarrier.try_wait.parity.shared::cta.b64 r, [%0], %1;\n@!r bra HMW;\n}\n" ::"r"(b),
      "r"(parity)
      : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n)); }

#define F8(x, o) "+f"(x[o]), "+f"(x[o + 1]), "+f"(x[o + 2]), "+f"(x[o + 3]), "+f"(x[o + 4]), "+f"(x[o + 5]), \
                 "+f"(x[o + 6]), "+f"(x[o + 7])

// S[64 x 64] (+)= Q[64 x 16] . K^T, both K-major in shared memory
__device__ __forceinline__ void qk(float (&d)[32], uint64_t a, uint64_t b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,"
      "%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : F8(d, 0), F8(d, 8), F8(d, 16), F8(d, 24)
      : "l"(a), "l"(b), "r"(acc)
      : "memory");
}
#define F64(d)                                                                                                 \
  F8(d, 0), F8(d, 8), F8(d, 16), F8(d, 24), F8(d, 32), F8(d, 40), F8(d, 48), F8(d, 56)
#define R64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
            "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,"    \
            "%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// O[64 x 128] += P[64 x 16] (registers) . V[16 x 128] (shared memory, MN-major)
__device__ __forceinline__ void pv_rs(float* d, const uint32_t (&a)[4], uint64_t b) {
  float(&o)[64] = *reinterpret_cast<float(*)[64]>(d);
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " R64 ", {%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n"
               : F64(o)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
               : "memory");
}
// O[64 x 128] += P[64 x 16] (shared memory, K-major) . V[16 x 128] (MN-major)
__device__ __forceinline__ void pv_ss(float* d, uint64_t a, uint64_t b) {
  float(&o)[64] = *reinterpret_cast<float(*)[64]>(d);
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " R64 ", %64, %65, 1, 1, 1, 0, 1;\n"
               : F64(o)
               : "l"(a), "l"(b)
               : "memory");
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(a), "f"(b));
  return r;
}

// Unpack `rows` 16-byte rows of codes of group g from src[] with the decode kernels' instruction mix (PRMT, SHF,
// LOP3, sub.bf16x2 per pair of codes) and store them as the token's rows of the tile (channel-octet-major)
__device__ __forceinline__ void unpack_rows(const uint32_t (&src)[8], int rows, int g, int lt, uint32_t tile) {
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if (r >= rows) break;
    uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t x = __byte_perm(src[r], 0, q ? 0x4342 : 0x4140);
      uint32_t lo = (x & 0x000F000Fu) | 0x43004300u, hi = ((x >> 4) & 0x000F000Fu) | 0x43004300u;
      asm("sub.rn.bf16x2 %0, %0, %1;\n" : "+r"(lo) : "r"(0x43004300u));
      asm("sub.rn.bf16x2 %0, %0, %1;\n" : "+r"(hi) : "r"(0x43004300u));
      o[2 * q] = lo, o[2 * q + 1] = hi;
    }
    const int oct = g * 16 + (lt >> 6) * rows + r, tok = lt & 63;  // a row of 8 channels of one token
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + oct * 1024 + (tok >> 3) * 128 +
                                                                          (tok & 7) * 16),
                 "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3])
                 : "memory");
  }
}

template <int MODE, int c>
__device__ __forceinline__ float consumer(uint8_t* smem, uint32_t s0, uint32_t bar, int tiles, int lt) {
    const int warp = lt >> 5, lane = lt & 31, t = lane & 3;
  float keep = 0.f;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  const float* meta = reinterpret_cast<const float*>(smem + kMeta);
  for (int k = 0; 2 * k < tiles; ++k) {
    const uint32_t kt = s0 + (c ? kK1 : kK0);
    float s[32], acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    if constexpr (MODE & 1) {
#pragma unroll 1
      for (int gg = 0; gg < 5; ++gg) {
        const int g = (MODE & 16) ? ord(gg) : gg;
        if constexpr (MODE & 4) mbar_wait(bar + 8 * (2 * g + c), k & 1);
        fence();
        const int k0 = g * 8, nk = g < 4 ? 8 : 4;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
          if (kk < nk)
            qk(acc, desc(s0 + kQ + (k0 + kk) * 2048, 1024, 128), desc(kt + (k0 + kk) * 2048, 1024, 128), kk > 0);
        commit();
        wait0();
        if constexpr (MODE & 8) {
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = fmaf(meta[g * 64 + 8 * (i >> 2) + 2 * t + (i & 1)], acc[i], s[i]);
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] += acc[i];
        }
      }
    } else if constexpr (MODE & 4) {
#pragma unroll 1
      for (int g = 0; g < 5; ++g) mbar_wait(bar + 8 * (2 * g + c), k & 1);
    }
    if constexpr (MODE & 16) {  // the RoPE part of the own tile is free; both score products are done before any
      mbar_arrive(bar + 96 + 8 * (2 * 4 + c));  // output product reads a tile (as the maxima exchange orders them)
      named_sync(3, 256);
    }
    uint32_t pa[4][4];  // P of the own tile as bf16 A fragments, 4 k-steps
    if constexpr (MODE & 8) {
      float mt[2] = {m[0], m[1]};
#pragma unroll
      for (int i = 0; i < 32; ++i) mt[(i >> 1) & 1] = fmaxf(mt[(i >> 1) & 1], s[i]);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        mt[v] = fmaxf(mt[v], __shfl_xor_sync(0xffffffffu, mt[v], 1));
        mt[v] = fmaxf(mt[v], __shfl_xor_sync(0xffffffffu, mt[v], 2));
      }
      float* xm = reinterpret_cast<float*>(smem + kMeta + 2048);
      if (t == 0) xm[c * 64 + 16 * warp + (lane >> 2)] = mt[0], xm[c * 64 + 16 * warp + (lane >> 2) + 8] = mt[1];
      named_sync(1, 256);
      mt[0] = fmaxf(mt[0], xm[(1 - c) * 64 + 16 * warp + (lane >> 2)]);
      mt[1] = fmaxf(mt[1], xm[(1 - c) * 64 + 16 * warp + (lane >> 2) + 8]);
      m[0] = mt[0], m[1] = mt[1];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        s[i] = ex2(s[i] - m[(i >> 1) & 1]);
        l[(i >> 1) & 1] += s[i];
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 4 * (2 * kk + (r >> 1)) + 2 * (r & 1);
          pa[kk][r] = pack_bf16(s[i], s[i + 1]);
        }
      uint32_t* pb = reinterpret_cast<uint32_t*>(smem + kP);  // publish (both WGs into one buffer: timing only)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pb[(kk * 512 + lt * 4 + r) & 2047] = pa[kk][r];
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_sync(2, 256);
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = __float_as_uint(s[(kk * 4 + r) & 31]) ^ 0x3F803F80u;
    }
    if constexpr (MODE & 2) {
      fence();
#pragma unroll
      for (int gl = 0; gl < 2; ++gl) {
        const int gi = 2 * c + gl;
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {  // own tile c (P in registers), the other (P in shared memory)
          const uint32_t v = s0 + (tile ? kK1 : kK0);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            const uint64_t bv = desc(v + gi * 16 * 1024 + kk * 256, 128, 1024);
            if (tile == c) pv_rs(o + 64 * gl, pa[kk], bv);
            else pv_ss(o + 64 * gl, desc(s0 + kP + kk * 2048, 1024, 128), bv);
          }
        }
        if constexpr ((MODE & 16) != 0) commit();
      }
      if constexpr ((MODE & 16) != 0) {  // each group's region of both buffers is free once its products are done
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        mbar_arrive(bar + 96 + 8 * (2 * (2 * c) + 0));
        mbar_arrive(bar + 96 + 8 * (2 * (2 * c) + 1));
        wait0();
        mbar_arrive(bar + 96 + 8 * (2 * (2 * c + 1) + 0));
        mbar_arrive(bar + 96 + 8 * (2 * (2 * c + 1) + 1));
      } else {
        commit();
        wait0();
      }
    }
    if constexpr ((MODE & 4) && !(MODE & 16)) {
      mbar_arrive(bar + 80);
      mbar_arrive(bar + 88);
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) keep += s[i];
  }
#pragma unroll
  for (int i = 0; i < 128; ++i) keep += o[i];
  keep += l[0] + l[1];
  return keep;
}

template <int MODE>
__global__ void __launch_bounds__(384, 1) hm(const uint8_t* pool, int tiles, float* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lt = tid & 127;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform for the compiler
  const uint32_t s0 = smem_u32(smem), bar = s0 + kBar;
  for (int i = tid; i < kBar / 16; i += 384)  // small exact bf16 values everywhere (no NaN / denormal timing)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0x3F803F80u ^ (i & 7), 0x40003F80u, 0x3F804000u, 0x3F803F80u);
  if (tid == 0) {
    for (int i = 0; i < 10; ++i) mbar_init(bar + 8 * i, 128);
    for (int i = 0; i < 2; ++i) mbar_init(bar + 80 + 8 * i, 256);
    for (int i = 0; i < 10; ++i) mbar_init(bar + 96 + 8 * i, 128);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint8_t* mine = pool + (size_t)blockIdx.x * tiles * kPageBytes;
  long long t0 = clock64();
  float keep = 0.f;
  if (wg == 0) {  // ---- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n");
    if constexpr ((MODE & 4) && (MODE & 16)) {  // groups in ord() order over both buffers, released one by one
      uint4 q[5][2];  // loads five steps ahead: slot = step % 5 (10 steps per iteration, unrolled)
      auto load = [&](int st, uint4 (&w)[2]) {  // step st = (k, group index, buffer): the thread's 32 bytes
        const int k = st / 10, gi = (st / 2) % 5, b = st & 1, j = 2 * k + b, g = ord(gi);
        if (j >= tiles) return;
        const uint8_t* page = mine + (size_t)j * kPageBytes;
        w[0] = *reinterpret_cast<const uint4*>(page + (g * 4096 + lt * 16) % 18432);
        w[1] = *reinterpret_cast<const uint4*>(page + (g * 4096 + 2048 + lt * 16) % 18432);
      };
#pragma unroll
      for (int i = 0; i < 5; ++i) load(i, q[i]);
      const int steps = tiles / 2 * 10;
      for (int s10 = 0; s10 < steps; s10 += 10)
#pragma unroll
      for (int i = 0; i < 10; ++i) {
        const int st = s10 + i;
        uint4 cur[2] = {q[i % 5][0], q[i % 5][1]};
        load(st + 5, q[i % 5]);
        const int k = st / 10, g = ord((st / 2) % 5), b = st & 1;
        if (k >= 1) mbar_wait(bar + 96 + 8 * (2 * g + b), (k - 1) & 1);
        const uint32_t tile = s0 + (b ? kK1 : kK0);
        const int rows = g < 4 ? 8 : 4;
        const uint32_t src[8] = {cur[0].x, cur[0].y, cur[0].z, cur[0].w, cur[1].x, cur[1].y, cur[1].z, cur[1].w};
        unpack_rows(src, rows, g, lt, tile);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(bar + 8 * (2 * g + b));
      }
    } else if constexpr (MODE & 4) {
      for (int j = 0; j < tiles; ++j) {
        const int b = j & 1;
        if (lt == 0 && j + 1 < tiles)
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(mine + (size_t)(j + 1) * kPageBytes),
                       "r"(kPageBytes)
                       : "memory");
        const uint8_t* page = mine + (size_t)j * kPageBytes;
        uint4 w[10];  // the thread's 160 bytes of the page, all loads in flight before the buffer is free
#pragma unroll
        for (int i = 0; i < 10; ++i) w[i] = *reinterpret_cast<const uint4*>(page + (i * 2048 + lt * 16) % 18432);
        if (j >= 2) mbar_wait(bar + 80 + 8 * b, ((j >> 1) - 1) & 1);
        const uint32_t tile = s0 + (b ? kK1 : kK0);
#pragma unroll
        for (int g = 0; g < 5; ++g) {  // group g: 4 content groups of 16 KB, then the RoPE 8 KB
          const int rows = g < 4 ? 8 : 4;  // 16-byte rows of codes per thread
          const uint4 wa = w[2 * g], wb = w[2 * g + 1];
          const uint32_t src[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
          unpack_rows(src, rows, g, lt, tile);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          mbar_arrive(bar + 8 * (2 * g + b));
        }
      }
    }
  } else {  // ---- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n");
    keep = wg == 1 ? consumer<MODE, 0>(smem, s0, bar, tiles, lt) : consumer<MODE, 1>(smem, s0, bar, tiles, lt);
  }
  const long long t1 = clock64();
  out[blockIdx.x * 384 + tid] = keep + (float)(t1 - t0) * 1e-30f;
}

template <int MODE>
void run(const MicroDevice& dev, const uint8_t* pool, int tiles, double flashmla_cycles_128, const char* what) {
  cudaFuncSetAttribute(hm<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const double cyc = best_cycles(dev, [&] { hm<MODE><<<dev.sms, 384, kSmem>>>(pool, tiles, dev.out); }, 5);
  const double per_tile = cyc / tiles;
  printf("mode %2d %-44s %7.0f cycles per 64-token tile per SM (x FlashMLA 128 heads: %.2f)  %s\n", MODE, what,
         per_tile, flashmla_cycles_128 / per_tile, cudaGetErrorString(cudaGetLastError()));
}

}  // namespace

int main() {
  const MicroDevice dev = micro_device(384);
  const int tiles = 256;  // per CTA (one CTA per SM): 5 MB of pages per SM, every page read from DRAM once
  uint8_t* pool;
  cudaMalloc(&pool, (size_t)dev.sms * tiles * kPageBytes);
  cudaMemset(pool, 0x5A, (size_t)dev.sms * tiles * kPageBytes);
  // FlashMLA BF16 at 128 heads, B32 x 32K (two 64-head CTAs per page, 32,768 page-CTAs): 437 us on the H200
  // (decode_vs_flashmla_h200_s19_heads.md) at 1.98 GHz over 132 SMs = ~3,490 SM cycles per 64-token tile
  const double fm = 437e-6 * 1.98e9 / (32768.0 / 132.0);
  printf("%d SMs, %.2f GHz; FlashMLA BF16 reference: %.0f cycles per tile at 128 heads (~5,030 at 64 heads)\n",
         dev.sms, dev.ghz, fm);
  run<1>(dev, pool, tiles, fm, "score products only");
  run<2>(dev, pool, tiles, fm, "output products only");
  run<3>(dev, pool, tiles, fm, "both products");
  run<4>(dev, pool, tiles, fm, "producer only (consumers wait)");
  run<5>(dev, pool, tiles, fm, "score products + producer");
  run<7>(dev, pool, tiles, fm, "products + producer");
  run<11>(dev, pool, tiles, fm, "products + arithmetic");
  run<15>(dev, pool, tiles, fm, "everything");
  run<23>(dev, pool, tiles, fm, "products + producer, groups released one by one");
  run<31>(dev, pool, tiles, fm, "everything, groups released one by one");
  return 0;
}
