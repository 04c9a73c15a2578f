// The warp-specialized many-heads decode kernel (decode_mla_sm90_ws.cu): its roles, shared-memory layout, the
// synchronization primitives it adds (mbarriers, named barriers, setmaxnreg), the m64n32k16 wgmma with the A operand
// in registers, and the index maps shared by the device code and the CPU checks (tests/kernels/test_cuda_compile.py
// compiles this header into a host program and compares the maps with the packing code).
//
// One CTA = 3 warpgroups = (32-head group, split, sequence), one CTA per SM:
//   WG 0      "score":  S_g^T[64 tokens x 32 heads] from the staged page (codes as register A), the softmax, and
//                       bf16/fp16(P s_g)^T tiles + per-head rescale factors into a double-buffered P area;
//   WG 1 + j  "output j" (j = 0, 1): O^T[256 channels (content groups 2j, 2j+1) x 32 heads] += codes^T (P s_g)^T,
//                       A = the same staged bytes through ldmatrix.trans; and the copy (cp.async) of the part of the
//                       next pages it reads itself (content chunks of its two groups; WG 1 also RoPE, WG 2 meta).
// Stage ring (kStages pages): full[s] (256 cp.async arrivals, the output threads) -> the score WG -> pfull[b] (128
// arrivals) -> the output WGs -> pempty[b] (256 arrivals) -> the score WG's next write of P buffer b; stage s is
// re-filled by each output WG right after its own last read of it (a WG-local named barrier, no cross-WG wait).
#pragma once

#include <stdint.h>

#include "mla_page.cuh"
#include "mla_wgmma.cuh"

namespace qmla {
namespace ws {

#ifndef QMLA_WS_STAGES  // pages in the shared-memory ring: up to kStages - 2 in flight while two are in use
#define QMLA_WS_STAGES 6
#endif
#ifndef QMLA_WS_REG_SCORE  // setmaxnreg: the score WG's registers and the output WGs' (ptxas, no spills: score 201,
                           // output 134 used; 216 + 2 x 144 = 3 x 168, the pool of a 384-thread CTA)
#define QMLA_WS_REG_SCORE 216
#endif
#ifndef QMLA_WS_REG_OUT
#define QMLA_WS_REG_OUT 144
#endif

#ifndef QMLA_WS_SUBNORMAL  // 1: the codes as exact fp16 subnormals in both products, no magic-number bias (the wgmma
#define QMLA_WS_SUBNORMAL 0  // kernel's QMLA_SM90_SUBNORMAL, its default since session 28: the output warpgroups lose
#endif  // an HFMA2 per pair of codes. H200, session 28: the ws GPU tests pass, C4R4 at 32 heads 1.01-1.02x
        // (kernel_variants_h200_s28_wssub.md); off because the symmetric C2R4 instantiations then spill 16 B)
constexpr bool kSub = QMLA_WS_SUBNORMAL;

constexpr int kWg = 128;           // threads per warpgroup
constexpr int kThreads = 3 * kWg;  // score + two output warpgroups
constexpr int kNH = 32;            // heads per CTA: N of every product
constexpr int kStages = QMLA_WS_STAGES;
constexpr int kQRow = kDc + kDr + 8;  // staged q's row stride (elements), as the wgmma kernel's
constexpr int kQkBlocks = 36;         // 16-channel k-blocks of the score product: 32 content + 4 RoPE
static_assert(QMLA_WS_REG_SCORE + 2 * QMLA_WS_REG_OUT <= 3 * 168, "the pool of 384 threads x 168 registers");
static_assert(QMLA_WS_REG_SCORE % 8 == 0 && QMLA_WS_REG_OUT % 8 == 0, "setmaxnreg counts are multiples of 8");

// named barriers (0 is __syncthreads): one per warpgroup
constexpr int kBarScore = 1, kBarOut0 = 2;

template <int CB, int RB>
struct Cfg : PageCfg<CB, RB> {
  using PageCfg<CB, RB>::STAGE;
  static constexpr int NC = kNH / 4;                 // a thread's head columns
  static constexpr int KB = kNH * 32;                // bytes of one 16 x 32 operand k-block (16-bit elements)
  static constexpr int PTB = 4 * 4 * KB;             // one P buffer: [group][k-step of 16 tokens][k-block]
  static constexpr int QSTAGE = kNH * kQRow * 2;     // bf16 q of the CTA's heads (over the P buffers, once)
  static constexpr int PTR = ((2 * PTB > QSTAGE ? 2 * PTB : QSTAGE) + 127) / 128 * 128;
  static constexpr int ST = 0;                        // [kStages] staged pages
  static constexpr int QT = ST + kStages * ((STAGE + 127) / 128 * 128);  // q^T k-blocks (fp16) [36][KB]
  static constexpr int PT = QT + kQkBlocks * KB;      // [2] P buffers
  static constexpr int ALPHA = PT + PTR;              // [2][kNH] floats: O's rescale per head; [2] ints: flags
  static constexpr int QB = ALPHA + 2 * kNH * 4 + 16; // [2][5][4 t][NC] floats: accumulator starts, q sums
  static constexpr int RED = QB + 2 * 5 * kNH * 4;    // [2][kNH][4 warps] floats: tile maxima (double-buffered)
  static constexpr int SMX = RED + 2 * kNH * 4 * 4;   // [2][4 warps] floats: the tile's largest content scale
  static constexpr int LSUM = SMX + 2 * 4 * 4;        // [kNH][4] floats: row sums (epilogue)
  static constexpr int ROFF = LSUM + kNH * 4 * 4;     // [4 groups][kNH][4] floats: offset sums (epilogue)
  static constexpr int FIN = ROFF + 4 * kNH * 4 * 4;  // [kNH] 1 / l, [4][kNH] offset terms, 2^-k (epilogue)
  static constexpr int MBAR = (FIN + (5 * kNH + 4) * 4 + 7) / 8 * 8;  // full[kStages], pfull[2], pempty[2]
  static constexpr int SMEM = MBAR + (kStages + 4) * 8;
  static_assert(QT % 128 == 0 && PT % 128 == 0 && QB % 16 == 0 && RED % 16 == 0, "aligned operand tiles");
  static_assert(SMEM <= 227 * 1024, "shared memory");
  static_assert(PageCfg<CB, RB>::CBYTES / 16 % 2 == 0, "content chunks split between the two output WGs");
};

// ---- index maps (host and device)

// Content chunk i (0 .. 64 CX / 2 / 128 - 1) of output WG j's local thread lt: token, and logical chunk of the row
// (the WG copies the chunks of its own two content groups: [j CX / 2, (j + 1) CX / 2)). Consecutive threads take
// consecutive 16-byte chunks of a token row.
template <int CX>
__host__ __device__ constexpr int copy_token(int lt, int i) { return (lt + kWg * i) / (CX / 2); }
template <int CX>
__host__ __device__ constexpr int copy_chunk(int j, int lt, int i) { return j * (CX / 2) + (lt + kWg * i) % (CX / 2); }
// where a staged page keeps logical chunk x of token n (mla_page.cuh's swizzle)
__host__ __device__ constexpr int swizzled_chunk(int x, int n) { return x ^ (n & 7); }

// Content chunk that warp w (0..3) of an output WG reads for group gi: ldmatrix.trans of 16 tokens x 16 bytes
__host__ __device__ constexpr int out_chunk(int CPG, int gi, int w) { return gi * CPG + w % CPG; }
// Channel of output row 16 w + r (r = g + 8 ri) of half hh of group gi (the wgmma kernel's permutation)
__host__ __device__ constexpr int out_channel(int CPG, int PS, int gi, int hh, int w, int r) {
  return kGroup * gi + 16 * (w % CPG) + 2 * (r % 8) + r / 8 + PS * (2 * (w / CPG) + hh);
}

// The score warpgroup's stores of (P s_g 2^k)^T (stmatrix.x4.trans, 8 x 8 matrices i = lane / 8 of head octet
// m = 2 q + i / 2 and k-half ri = i % 2): byte offset in the P buffer of the row lane gives for x4 store (gi, q) of
// warp w (its 16 tokens are k-step w), = p_store_row(w, lane) + p_store_step(gi, q); a P buffer is [group][k-step]
// K-major 16 x 32 k-blocks of kNH * 32 bytes (mla_wgmma.cuh's layout)
__host__ __device__ constexpr int p_store_row(int w, int lane) { return p_tile_row(kNH * 32, w, lane); }
__host__ __device__ constexpr int p_store_step(int gi, int q) { return gi * 4 * kNH * 32 + q * 512; }

// mbarrier phase parities: the n-th completion of a barrier has parity n & 1
__host__ __device__ constexpr uint32_t full_parity(int it) { return (uint32_t)(it / kStages) & 1u; }
__host__ __device__ constexpr uint32_t pfull_parity(int it) { return (uint32_t)(it / 2) & 1u; }
// the score WG's wait, before writing P buffer it % 2, for the output WGs' use of tile it - 2 (it >= 2)
__host__ __device__ constexpr uint32_t pempty_parity(int it) { return (uint32_t)(it / 2 - 1) & 1u; }

#if defined(__CUDACC__)
// ---- synchronization

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// arrive once every cp.async this thread issued before it has landed (counts against the expected arrivals)
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// block until the phase of parity `parity` has completed
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred ready;\nWS_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WS_MBAR_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// this thread's lane, read inside a role (volatile: the compiler keeps lane-derived values out of the code before
// the role branch, where they would live across setmaxnreg's register-count change and spill)
__device__ __forceinline__ int lane_id() {
  int l;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
  return l;
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// arrive on a named barrier without waiting (a producer's half of a named-barrier hand-off; the hm kernel's consumers)
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// D[64 x 32] += A[64 x 16] (fp16, registers) * B[16 x 32] (fp16, shared memory, K-major: mla_wgmma.cuh's layout)
__device__ __forceinline__ void wgmma_f16_n32(float (&d)[16], const uint32_t (&a)[4], uint32_t desc_lo,
                                              uint32_t desc_hi) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 desc;\nsetp.ne.b32 p, %22, 0;\nmov.b64 desc, {%20, %21};\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16"
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15},"
      " {%16, %17, %18, %19}, desc, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo), "r"(desc_hi), "r"(1)
      : "memory");
}
#endif

}  // namespace ws
}  // namespace qmla
