// Packed low-bit MLA decode attention for Hopper (sm_90a), many heads: the warp-specialized "ws" kernel.
//
// Same contract, page layout, partial outputs and merge as decode_mla_sm90.cu (the 16-head swap-AB wgmma kernel),
// whose per-tile math it reuses unchanged: tokens on M (64-token pages), heads on N, codes as the register A operand
// of both products (fp16 magic numbers for the score product, exact fp16 codes from ldmatrix.trans for the output
// product), per-token scales as row scales, the offsets as rank-1 terms, the lazy running maximum, P s 2^k in fp16.
//
// What is new is the CTA: 32 heads (N = 32 of every m64n32k16) and three warpgroups with one role each, so that each
// code is unpacked once for the score product and once for the output product per 32 heads (the 16-head kernels:
// per 16), and the unpacking, softmax and products of different pages overlap across warpgroups instead of
// following each other in one:
//   WG 0: score product + softmax of page i, (P s_g)^T into P buffer i % 2            (mla_ws_score.cuh)
//   WG 1, WG 2: output product of page i - 1 or i for content groups {0, 1} / {2, 3}; each copies the bytes of the
//         pages it reads itself, kStages pages ahead, with cp.async tracked by mbarriers (mla_ws_output.cuh)
// The ring, the barriers and the shared-memory layout: mla_ws_cfg.cuh. Registers: launched at 384 x 168, then
// setmaxnreg gives the score warpgroup 216 (five 64 x 32 score accumulators) and the output warpgroups 144 each
// (four 64 x 32 output accumulators). One CTA per SM (~155 KB of shared memory at 4 stages).
//
// Formats: 4-bit and 2-bit content with 4-bit RoPE (C4R4, C2R4); the host refuses the others for this kernel. Heads:
// any count, in groups of 32 (one CTA each; 16 heads run as a 32-head CTA with 16 empty columns).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_launch.cuh"
#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"
#include "mla_ws_cfg.cuh"
#include "mla_ws_output.cuh"
#include "mla_ws_score.cuh"

namespace qmla {
namespace ws {

// CTA barriers of the score warpgroup's q staging (stage_q: 1, stage_qt: 2), matched by the output warpgroups
constexpr int kQStagingBarriers = 3;

template <int CB, int RB, bool CSYM, bool RSYM>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel_ws(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using C = Cfg<CB, RB>;
  extern __shared__ __align__(128) uint8_t smem[];

  pdl_launch_dependents();  // the split merge may launch now (QMLA_PDL; it waits for this grid to finish)
#if QMLA_PDL
  if (!p.pdl_late) pdl_wait();  // before the first read, unless the kernel before is the buffer kernel
#endif
  const int hg = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / kWg, 0);  // warp-uniform for the compiler (setmaxnreg regions)
  const int h0 = hg * kNH;
  const int n = p.lens[b];
  const int lo = p.sink;
  const int hi = max(n - p.local, p.sink);
  const int pg0 = lo / kPage + sp * p.pps;
  const int pg1 = min(pg0 + p.pps, (hi + kPage - 1) / kPage);
  if (empty_split_leaves(p, pg0, pg1)) return;  // a split without pages (ragged lengths): the merge skips it
  const int* bt = p.block_table + (long long)b * p.bt_stride;
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
  const uint32_t mbar = smem_u32(smem + C::MBAR);  // full[kStages], pfull[2], pempty[2]

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(mbar + 8 * s, 2 * kWg);  // every output thread's cp.async arrival
    mbar_init(mbar + 8 * kStages, kWg);                                  // pfull: the score warpgroup
    mbar_init(mbar + 8 * (kStages + 1), kWg);
    mbar_init(mbar + 8 * (kStages + 2), 2 * kWg);                        // pempty: the output warpgroups
    mbar_init(mbar + 8 * (kStages + 3), 2 * kWg);
    mbar_init_fence();
  }
  __syncthreads();

  if (wg != 0) {
    regs_dec<QMLA_WS_REG_OUT>();
    const int j = wg - 1, lt = tid - kWg * wg;
    using M = MetaRows<CSYM, RSYM>;
    constexpr int kStageBytes = (C::STAGE + 127) / 128 * 128;
#pragma unroll
    for (int s = 0; s < kStages; ++s)
      if (pg0 + s < pg1)
        copy_part<CB, RB>(smem_u32(smem + C::ST + s * kStageBytes), p.pool + (long long)bt[pg0 + s] * p.page_bytes,
                          p, M::ROWS, j, lt, mbar + 8 * s);
#pragma unroll
    for (int i = 0; i < kQStagingBarriers; ++i) __syncthreads();
    output_role<CB, RB, CSYM, RSYM>(p, smem, j, pg0, pg1, bt, row0, h0);  // ends with the epilogue barrier
  } else {
    regs_inc<QMLA_WS_REG_SCORE>();
    // q: bf16(q qk_scale) staged over the P buffers, the CTA's exponent e, q^T (fp16) and the accumulator starts
    // (bf16 q: 16-byte loads, all in flight; fp32 q: the pair loads one after another -- their in-flight form, 72
    // pairs of 32 heads, spilled)
    __nv_bfloat16* qst = reinterpret_cast<__nv_bfloat16*>(smem + C::PT);
    const int e = stage_q<kNH, kWg, false, kQRow>(qst, reinterpret_cast<float*>(smem + C::RED), p, b, h0);
    stage_qt<CB, RB, CSYM, RSYM, kNH, kWg, kQRow, kSub>(smem + C::QT, qst, exp2i(-e),
                                                  reinterpret_cast<float*>(smem + C::QB));
    score_role<CB, RB, CSYM, RSYM>(p, smem, e, pg0, pg1, lo, hi, row0, h0);
    __syncthreads();  // FIN is published (the output warpgroups' epilogue barrier)
  }
#if QMLA_PDL
  if (p.pdl_late) pdl_wait();  // this grid completes after the buffer kernel: the merge's wait then covers both
#endif
#endif
}

// The kernel family for mla_launch.cuh.
struct WsKernel {
  static constexpr int kThreads = ws::kThreads;
  template <int CB, int RB>
  static constexpr bool has = RB == 4 && (CB == 4 || CB == 2);
  template <int CB, int RB>
  static constexpr bool has_token_scale = false;  // C4R4T / C2R4T: the 16-head kernel (decode_mla_sm90.cu) only
  static int heads_per_cta(int, int) { return kNH; }
  static int head_ctas(int H, int) { return (H + kNH - 1) / kNH; }
  template <int CB, int RB>
  static int smem(int) {
    if constexpr (has<CB, RB>) return Cfg<CB, RB>::SMEM;
    else return 0;
  }
  template <int CB, int RB, bool CSYM, bool RSYM>
  static KernelFn fn(int) {
    if constexpr (has<CB, RB>) return decode_kernel_ws<CB, RB, CSYM, RSYM>;
    else return nullptr;
  }
};

}  // namespace ws

template <>  // with QMLA_PDL a programmatic launch, as the wgmma kernel's (it waits for the kernel before it itself)
struct ProgrammaticLaunch<ws::WsKernel> {
  static constexpr bool value = QMLA_PDL;
};

// 1 when the library launches programmatically (QMLA_PDL): cuda_decode.py then runs the buffer kernel on the same
// stream just before the page kernel (Params::pdl_late).
extern "C" int qmla_pdl() { return QMLA_PDL; }
}  // namespace qmla

// The same C entry points as decode_mla.cu (a separate library); grid (head_ctas(H), splits, B).
QMLA_EXPORT_DECODE(qmla::ws::WsKernel)
