// The Hopper swap-AB decode kernel's (decode_mla_sm90.cu) compile-time tuning knobs and shared-memory layout.
#pragma once

#include "mla_page.cuh"

namespace qmla {
namespace sm90 {

// Tuning knobs (compile-time; benchmarks/kernel_variants.py builds copies with other values and times them side by side):
// wgmma batches in flight after each commit in the score / output products, minimum CTAs per SM.
#ifndef QMLA_SM90_QK_DEPTH
#define QMLA_SM90_QK_DEPTH 1
#endif
#ifndef QMLA_SM90_PV_DEPTH
#define QMLA_SM90_PV_DEPTH 1
#endif
#ifndef QMLA_SM90_MIN_CTAS
#define QMLA_SM90_MIN_CTAS 2
#endif
#ifndef QMLA_SM90_PV_F16  // 1: the 4/2-bit output product in fp16 as well (see kF16Out below); default since
#define QMLA_SM90_PV_F16 1  // 2026-12-01 (H200: 1-2% faster, 10x smaller error than bf16: kernel_variants_h200_s12.md)
#endif

#ifndef QMLA_SM90_SCORE_RUN  // two score accumulator sets (content groups in turn, RoPE last), each group folded into
#define QMLA_SM90_SCORE_RUN 1  // a running fp32 score once its products are done, instead of five sets live to the end
#endif  // of the product. 0: never; 1 (default since 2026-12-02): 4-bit RoPE formats (C4R4, C2R4); 2: every packed
        // format. H200, 16 heads, vs five sets (kernel_variants_h200_s21_run.md): C2R4 1.00-1.03x, C4R4 0.99-1.01x
        // (session 20: 1.00-1.05x), C8R8 0.99-1.01x, C4R8 0.99-1.00x -- so on where it gains, off where it does not

// Fewer instructions per tile (written offline 2026-12-02, session 21; default since the H200 measured them, session
// 22: all five levers together -- these three and QMLA_PRMT8 / QMLA_PAGE_BASES -- 1.00-1.12x over the former forms
// at every packed format and shape, C8R8 1.12x, kernel_variants_h200_s22_levers.md). 0 selects the former form.
#ifndef QMLA_SM90_P_STSM  // 1: the (P s)^T tiles of the fp16 output product written with one stmatrix.x4.trans
#define QMLA_SM90_P_STSM 1  // per group (16 paired conversions) instead of 32 two-byte stores and 32 single
#endif                      // conversions per thread
#ifndef QMLA_SM90_ADDR_BASES  // 1: shared-memory addresses of the page's ldmatrix from a few per-tile bases plus
#define QMLA_SM90_ADDR_BASES 1  // constants, not the swizzle recomputed per batch (the same addresses)
#endif
#ifndef QMLA_SM90_LDSM_AHEAD  // batches ahead that each product's ldmatrix is issued: 2 since session 28 (ncu had
#define QMLA_SM90_LDSM_AHEAD 2  // ~10% of the stall samples on the first shift after an ldmatrix one batch ahead;
#endif  // H200: C4R4 1.01-1.02x, C4R4T 1.03-1.04x over 1, 244 registers, no spills, kernel_variants_h200_s28_ldsm2.md)
#ifndef QMLA_SM90_META_ONCE  // 1 (with two score sets, QMLA_SM90_SCORE_RUN): the scales and offsets the fold reads
#define QMLA_SM90_META_ONCE 1  // are kept for the softmax, not read and converted again (load_meta)
#endif

#ifndef QMLA_SM90_STAGES  // pages staged in shared memory (packed formats): 2 = the page being read and the next
#define QMLA_SM90_STAGES 2  // one in flight; 3 keeps two in flight (+1 page of shared memory: C4R4 68 -> 88 KB, still
#endif  // two CTAs per SM; C8R8 105 -> 143 KB, one). Session 31's ablations (kernel_variants_h200_s31_ablate.md) ran
        // the loop without its products at 2.7-2.9 TB/s: does a second page in flight lift that floor? Offline only.

#ifndef QMLA_SM90_LATE_COPY  // 1 (with QMLA_SM90_STAGES=3): a tile's next page copy is issued after its P barrier,
#define QMLA_SM90_LATE_COPY 0  // into the stage the tile before read, and waited for before the next tile's P
#endif  // barrier, so the barrier at the top of the tile goes (two a tile instead of three; the same cover, ~one tile).
        // Session 32, offline.

#ifndef QMLA_SM90_VOTE  // 1: the softmax exchanges its tile maximum and largest scale across the warps (shuffles,
#define QMLA_SM90_VOTE 0  // shared memory, a barrier) only when a barrier-vote says some thread's scores pass the lazy
#endif  // threshold or its scales would overflow k, and every 8 tiles; else one OR-barrier and nothing moves (~45
        // fewer instructions per warp and tile). Session 32, offline.

#ifndef QMLA_SM90_SUBNORMAL  // 1 (fp16 output product): packed codes enter both products as exact fp16 subnormals
#define QMLA_SM90_SUBNORMAL 1  // 2^k c 2^-24 (the field masked in place, nothing above it) instead of the magic
#endif  // numbers 1024 + 2^k c: no bias in either product -- the score accumulators start at zero (asymmetric paths),
        // the output product loses its HFMA2 per pair, the T formats' content shares one score accumulator -- and a
        // constant 2^-24 (x 2^-k per plane) undone in the softmax scale and the epilogue. Default since session 28
        // (H200: the tensor cores take fp16 subnormals exactly -- every wgmma GPU test passed -- C4R4 1.02-1.03x,
        // C4R4T 1.04-1.05x, C2R4T 1.04-1.07x, C8R8 / C4R8 0.99-1.04x; kernel_variants_h200_s28_subnormal.md; it
        // replaced session 22's QMLA_SM90_PV_MAGIC8). 0 selects the magic numbers (the decode_mla.cu kernel's form).

// (QMLA_SM90_TOKEN_SCALE, session 26's spike of one content scale per token, became the T formats' instantiation:
// decode_kernel_sm90<..., TS = true>, C4R4T / C2R4T.)
//
// decode_kernel_sm90's TS: one content scale and offset per token (the T formats, C4R4T / C2R4T; meta rows CS, CO = 0,
// 1): the content groups' score accumulators are summed as they are (one FADD per element, no per-group scale or
// offset), scaled once, and the output product takes one (P s)^T tile and one offset sum. With subnormal codes (the
// default) all four groups share one accumulator (kOneAcc): nothing large cancels in it. With magic numbers each group
// runs its own accumulator from its own start -(1024 sum q_g), summed once small: one magic-number accumulator for all
// 512 channels (session 26's spike) carried 4x the 1024 sum q terms and its LSE error grew ~10x (up to 8.7e-3 at unit
// values, H200 2026-12-03), failing at large values.

constexpr int kThreads = 128;  // one warpgroup
constexpr int kQRow = kDc + kDr + 8;  // staged q's row stride (elements): 8 heads' rows on distinct shared banks
constexpr int kStages = QMLA_SM90_STAGES;
static_assert(kStages == 2 || kStages == 3, "2 or 3 staged pages");
constexpr bool kLateCopy = QMLA_SM90_LATE_COPY;
constexpr bool kVote = QMLA_SM90_VOTE;
static_assert(!kLateCopy || kStages == 3, "QMLA_SM90_LATE_COPY needs QMLA_SM90_STAGES=3");
constexpr int kMinCtas = QMLA_SM90_MIN_CTAS;  // __launch_bounds__ minimum CTAs per SM
constexpr int kQkDepth = QMLA_SM90_QK_DEPTH, kPvDepth = QMLA_SM90_PV_DEPTH;
constexpr int kLdsmAhead = QMLA_SM90_LDSM_AHEAD;
static_assert(kLdsmAhead == 1 || kLdsmAhead == 2, "ldmatrix 1 or 2 batches ahead");
constexpr int kQkBlocks = 36;  // 16-channel k-blocks of the score product: 32 content + 4 RoPE

// NH = 16 heads on N of every wgmma. (A 32-head variant ran slower: see WgmmaKernel below.)
template <int CB, int RB, int NH>
struct Cfg : PageCfg<CB, RB> {
  using PageCfg<CB, RB>::STAGE;
  static_assert(NH == 16, "16 heads per CTA");
  static constexpr int KB = NH * 32;                  // bytes of one 16 x NH operand k-block (16-bit elements)
  static constexpr int NG = 4;                         // content groups of the output product
  static constexpr int QSTAGE = NH * kQRow * 2;        // bf16 q of the CTA's heads, once, from stage 1 on
  static constexpr int PTB = NG * 4 * KB;             // (P s_g)^T k-blocks [group][k-step][k-block]
  static constexpr int PTR = (QSTAGE - STAGE > PTB ? QSTAGE - STAGE + 127 : PTB) / 128 * 128;  // (q staging too)
  static constexpr int PT = kStages * STAGE;          // bf16 P tiles (fp16: C8)
  static constexpr int QB = PT + PTR;                  // [2][5 groups][t][NH / 4] floats: accumulator starts, q sums
  static constexpr int RED = QB + 2 * 5 * NH * 4;      // [head][warp] floats: tile maxima, row sums
  static constexpr int SMX = RED + NH * 4 * 4;         // [warp] floats: the tile's largest content scale (C8)
  static constexpr int ROFF = SMX + 4 * 4;             // [group][head][warp] floats: offset sums
  static constexpr int QT = ROFF + NG * NH * 4 * 4;    // q^T k-blocks (fp16) [36][k-block]
  static constexpr int SMEM = QT + kQkBlocks * KB;
  static_assert(QSTAGE <= STAGE + PTR, "q staging fits in the last stage and the P tiles");
  static_assert(QT % 16 == 0 && PT % 16 == 0 && QB % 16 == 0, "operand tiles are 16-byte aligned");
};

}  // namespace sm90
}  // namespace qmla
