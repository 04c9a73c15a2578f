// Packed low-bit MLA decode attention for Hopper (sm_90a): "swap-AB" warpgroup products, tokens on M.
//
// Same contract, page layout, launch grid and partial-output layout as decode_mla.cu (the mma.sync kernel for
// sm_80+): one CTA = one warpgroup (4 warps) = one (16-head group, split, sequence); the BF16 sink/local buffers
// and the merge of the splits run elsewhere (quantmla/kernels/cuda_decode.py). The torch reference of the same byte
// layout is the definition: quantmla/kernels/reference.py.
//
// Per 64-token tile (one page), with the 16 heads on N of every wgmma (m64n16k16) and the page's codes as the
// register A operand, so each code is unpacked once per product for all heads:
//   score   S_g^T[64 tokens x 16 heads] = K_g Q_g^T   per content group g (4 x 8 k-blocks) and for RoPE (4 k-blocks):
//           A = codes as exact fp16 subnormals 2^(b p) c 2^-24 (QMLA_SM90_SUBNORMAL, the default: one AND per pair;
//           =0: magic numbers 1024 + 2^(b p) c, one LOP3 per pair, as in decode_mla.cu; ldmatrix of the staged page,
//           the A fragment of tokens 16w+g / 16w+g+8 is exactly what mma.sync's B fragment was), B = q^T (fp16,
//           2^-e and 2^-(b p) folded in, the channel order of the fragments), staged once per CTA. Accumulators
//           start at the symmetric offset (0 for asymmetric paths; magic numbers: also -1024 sum(q)), so they end
//           holding q . c (x 2^-24, undone in the softmax scale); then
//           S = sum_g s_g[t] S_g + o_g[t] qsum_g   (per-token scales are row scales of S^T: never per element).
//   softmax over the 64 rows per head (one cross-warp exchange of the tile maximum; lazy running maximum as in
//           decode_mla.cu); row sums and the offset terms sum_t P o_g[t] stay per thread until the epilogue.
//   output  O_(g,h)^T[64 channels x 16 heads] += V_(g,h)^T (P s_g)^T   for the two 64-channel halves h of group g
//           (mla_sm90_pv.cuh): A = the codes exact in fp16 (QMLA_SM90_PV_F16, the default: subnormals, 2^(b p) 2^-24
//           undone per accumulator in the epilogue; bf16 otherwise), from ldmatrix.trans of the same staged bytes
//           (pairs of tokens of one channel), B = (P s_g)^T written to shared memory by the softmax.
// The output's M rows are a permutation of the group's channels (the fields of one ldmatrix.trans element):
// row 16w + r of half h of group g = channel 128 g + 16 (w % CPG) + 2 (r % 8) + r / 8 + PS (2 (w / CPG) + h).
// Asynchrony: the output product of tile i runs on the tensor cores while the score product of tile i + 1 is
// being unpacked; wgmma_wait<0> before the softmax covers both.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_fused_merge.cuh"
#include "mla_ops.cuh"
#include "mla_launch.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_sm90_ablate.cuh"
#include "mla_sm90_bf16.cuh"
#include "mla_sm90_cfg.cuh"
#include "mla_sm90_pv.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"

namespace qmla {
namespace sm90 {

template <int CB, int RB, bool CSYM, bool RSYM, int NH, bool TS = false>  // TS: the T formats (mla_sm90_cfg.cuh)
__global__ void __launch_bounds__(kThreads, kMinCtas) decode_kernel_sm90(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using C = Cfg<CB, RB, NH>;
  constexpr int NC = NH / 4, NG = C::NG, kKBlock = C::KB, kHeads = NH;  // NC: a thread's head columns
  using M = MetaRows<CSYM, RSYM, TS ? 1 : 4>;
  constexpr int F = C::F, CPG = C::CPG, CX = C::CBYTES / 16, PS = C::PS;
  constexpr int RF = C::RF, RCH = C::RCH;
  // 8-bit content: the output product runs in fp16 (bf16 cannot hold 128 + c for c >= 128), so P s, whose range is
  // the scales' (anything fp16 holds), is carried as P s 2^k: k from the largest content scale seen (the largest
  // P s 2^k in [2^14, 2^15)), moved lazily (when a tile's scales would overflow, or have shrunk 2^8-fold) with an
  // exact power-of-two rescaling of the fp32 accumulators, and undone in the epilogue
  constexpr bool kC8 = CB == 8;
  // fp16 output product: always for 8 bits; for 4/2 bits with QMLA_SM90_PV_F16 (a field becomes 1024 + 2^(b p) c
  // with one LOP3 in place -- one shared 8-bit shift per register for the upper byte -- and exact c with one HFMA2,
  // instead of bf16's shift + LOP3 + FMA per pair; P s then needs the 2^k scaling below, and carries 11 bits)
  constexpr bool kF16Out = kC8 || QMLA_SM90_PV_F16;
  constexpr bool kTS = TS;
  // QMLA_SM90_SUBNORMAL: codes as exact fp16 subnormals in both products (mla_ops.cuh), no magic bias; with one content
  // scale per token the four content groups then share one score accumulator (nothing large to cancel in it)
  constexpr bool kSub = QMLA_SM90_SUBNORMAL && kF16Out;
  constexpr bool kOneAcc = kTS && kSub;
  static_assert(!TS || (RB == 4 && CB != 8 && !CSYM && !RSYM && QMLA_SM90_SCORE_RUN >= 1 && QMLA_SM90_META_ONCE),
                "one content scale per token: 4/2-bit content, asymmetric 4-bit RoPE, two score sets, meta read once");
  constexpr int NPT = kTS ? 1 : 4;  // (P s)^T tiles, offset sums and scale vectors per tile
  static_assert(CB == 2 || CB == 4 || CB == 8, "content bits");
  static_assert(RB == 4 || RB == 8, "RoPE bits");
  extern __shared__ __align__(128) uint8_t smem[];
  float* qb = reinterpret_cast<float*>(smem + C::QB);     // [2][5][4 t][NC]
  float* red = reinterpret_cast<float*>(smem + C::RED);   // [head][warp]
  float* roff = reinterpret_cast<float*>(smem + C::ROFF);  // [group][head][warp]
  float* smx = reinterpret_cast<float*>(smem + C::SMX);    // [warp]

  pdl_launch_dependents();  // the split merge may launch now (QMLA_PDL; it waits for this grid to finish)
#if QMLA_PDL  // a programmatic launch (mla_launch.cuh): the kernel before it must be complete
  if (!p.pdl_late) pdl_wait();    // before the first read, unless it is the buffer kernel (then: at the end)
#endif
  const int hg = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int h0 = hg * kHeads;
  const int n = p.lens[b];
  const int lo = p.sink;
  const int hi = max(n - p.local, p.sink);
  const int pg0 = lo / kPage + sp * p.pps;
  const int pg1 = min(pg0 + p.pps, (hi + kPage - 1) / kPage);
  if (empty_split_leaves(p, sp, pg0, pg1)) return;  // a split without pages: the merge skips it (mla_fused_merge.cuh)

  const int* bt = p.block_table + (long long)b * p.bt_stride;
  auto issue = [&](int blk, int st) {  // blk: the page's block-table entry
    const uint8_t* page = p.pool + (long long)(kAblate & kAblateDram ? min(blk, 0) : blk) * p.page_bytes;
    load_page<CB, kThreads, RB>(smem_u32(smem + st * C::STAGE), page, p, M::ROWS);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (pg0 + s < pg1) issue(bt[pg0 + s], s);
    cp_async_commit();
  }
  // the block-table entry of the page issued next, read one tile before its use (read where used, its global load
  // stalled every tile's copy issue: ncu 2026-12-01)
  int blk_next = pg0 + kStages - 1 < pg1 ? bt[pg0 + kStages - 1] : 0;

  // ---- q: bf16(q * qk_scale) staged from the last stage on (coalesced pairs), the CTA's largest |q| -> e; then q^T
  // as the B operand of the score product, the accumulator starts and q sums (mla_swapab.cuh). (Staging q once per
  // sequence and head group in a prep kernel instead was 0.96-0.98x at B32 x 32K / B8 x 128K:
  // kernel_variants_h200_s14a.md.)
  // [head][kQRow], over the last stage (the first copy into it is issued by the loop) and PT
  __nv_bfloat16* qst = reinterpret_cast<__nv_bfloat16*>(smem + (kStages - 1) * C::STAGE);
  const int e = stage_q<kHeads, kThreads, true, kQRow>(qst, red, p, b, h0);
  stage_qt<CB, RB, CSYM, RSYM, kHeads, kThreads, kQRow, kSub>(smem + C::QT, qst, exp2i(-e), qb);
  const float two_e = exp2i(kSub ? e + 24 : e);  // (kSub: scores are carried in 2^(-e - 24) units)
  const uint32_t qt_u = smem_u32(smem + C::QT);
  if constexpr (kTS) {  // row 0 of the q sums becomes the whole content's (read after the loop's barrier)
    if (tid < NH) {
      float q = 0.f;
#pragma unroll
      for (int gr = 0; gr < 4; ++gr) q += qb[5 * NH + gr * NH + tid];
      qb[5 * NH + tid] = q;
    }
  }

  const Desc qdesc(wgmma_desc(qt_u, 128, 256)), pdesc(wgmma_desc(smem_u32(smem + C::PT), 128, 256));

  float oacc[2 * NG][NH / 2];  // [2 group + half][d]: O^T of this thread's rows / heads
#pragma unroll
  for (int i = 0; i < 2 * NG; ++i)
#pragma unroll
    for (int j = 0; j < NH / 2; ++j) oacc[i][j] = 0.f;
  float m_run[NC], l_run[NC], po[NG][NC];  // per head column c; po: [group][c]
  int k_run = 0;                        // C8: P s is carried as P s 2^k_run (CTA-uniform)
  bool k_set = false;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    m_run[c] = -INFINITY;
    l_run[c] = 0.f;
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) po[gi][c] = 0.f;
  }
  const int vshift = CB * 2 * (warp / CPG);  // the two planes this warp's output rows take from each byte

  auto next_copy = [&](int it, int pg) {  // page pg + kStages - 1's copy, then the block-table entry after it
    if (pg + kStages - 1 < pg1) issue(blk_next, (it + kStages - 1) % kStages);
    cp_async_commit();
    if (pg + kStages < pg1) blk_next = bt[pg + kStages];
  };
  if constexpr (kLateCopy) {  // the first page (later ones are waited for at the P barrier of the tile before)
    cp_async_wait<kStages - 2>();
    __syncthreads();
  }
  for (int it = 0; pg0 + it < pg1; ++it) {
    const int pg = pg0 + it;
    if constexpr (!kLateCopy) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      next_copy(it, pg);
    }

    const uint8_t* st = smem + (it % kStages) * C::STAGE;
    const uint32_t st_u = smem_u32(st);
    const __half* meta = reinterpret_cast<const __half*>(st + C::M_SM);
    const int tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;  // valid tokens: [tok_lo, tok_hi)
    const bool edge = tok_lo > 0 || tok_hi < kPage;

    // ---- (1) score product, 2^-e units: sacc[group][d], group 4 = RoPE (QMLA_SM90_SCORE_RUN: sacc[group % 2] for the
    // content groups in turn, then sacc[0] for RoPE; each group is folded into srun once its products are done)
    constexpr bool kRun = QMLA_SM90_SCORE_RUN == 2 || (QMLA_SM90_SCORE_RUN == 1 && RB == 4);  // mla_sm90_cfg.cuh
    constexpr bool kMetaOnce = kRun && QMLA_SM90_META_ONCE;  // the fold's scale / offset reads kept for the softmax
    float sv[4][2], ov[4][2], rsv[2], rov[2];  // content scales / offsets [group][ri], RoPE scale / offset [ri]
    constexpr int kSets = kRun ? 2 : 5;
    float sacc[kSets][NH / 2];
    auto slot = [](int gr) { return kOneAcc ? (gr == 4 ? 1 : 0) : kRun ? (gr == 4 ? 0 : gr & 1) : gr; };
    auto init_acc = [&](int gr) {  // the accumulator start of group gr (mla_swapab.cuh stage_qt)
      float iv[NC];  // (kSub, asymmetric: zeros, read as values -- zero constants let ptxas serialize every wgmma)
      load_row<NC>(iv, qb + gr * NH + t * NC);
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) sacc[slot(gr)][acc_idx(ri, c)] = iv[c];
      fence_operands(sacc[slot(gr)]);
    };
#pragma unroll
    for (int gr = 0; gr < kSets; ++gr) init_acc(kOneAcc && gr == 1 ? 4 : gr);
    float srun[2][NC];  // kRun: the score so far, s_g S_g + o_g qsum_g summed over the folded groups
    auto fold = [&](int gr) {  // kRun: group gr's products are complete (the caller waited): srun += its term
      fence_operands(sacc[slot(gr)]);
      if constexpr (kTS) {
        if (gr < 3) {  // content groups 0-2: summed unscaled (srun holds sum_g S_g until group 3)
#pragma unroll
          for (int ri = 0; ri < 2; ++ri)
#pragma unroll
            for (int c = 0; c < NC; ++c) srun[ri][c] += sacc[slot(gr)][acc_idx(ri, c)];
          return;
        }
        if (gr == 3) {  // the last content group: srun = s sum_g S_g + o sum_g qsum_g (q sums of row 0: their sum)
          float qsv[NC];
          load_row<NC>(qsv, qb + 5 * NH + t * NC);
#pragma unroll
          for (int ri = 0; ri < 2; ++ri) {
            const int tau = 16 * warp + g + 8 * ri;
            const float sg = __half2float(meta[M::CS * kPage + tau]), og = __half2float(meta[M::CO * kPage + tau]);
            sv[0][ri] = sg;
            ov[0][ri] = og;
#pragma unroll
            for (int c = 0; c < NC; ++c)
              srun[ri][c] = fmaf(sg, (kOneAcc ? 0.f : srun[ri][c]) + sacc[slot(gr)][acc_idx(ri, c)], og * qsv[c]);
          }
          return;
        }
      }
      float qsv[NC];
      load_row<NC>(qsv, qb + 5 * NH + gr * NH + t * NC);
      const bool sym = gr < 4 ? CSYM : RSYM;
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int tau = 16 * warp + g + 8 * ri;
        const float sg = __half2float(meta[(gr < 4 ? M::CS + gr : M::RS) * kPage + tau]);
        const float og = sym ? 0.f : __half2float(meta[(gr < 4 ? M::CO + gr : M::RO) * kPage + tau]);
        if constexpr (kMetaOnce) {
          if (gr < 4) {
            sv[gr][ri] = sg;
            ov[gr][ri] = og;
          } else {
            rsv[ri] = sg;
            rov[ri] = og;
          }
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const float a = sacc[slot(gr)][acc_idx(ri, c)];
          srun[ri][c] = sym ? fmaf(sg, a, srun[ri][c]) : fmaf(sg, a, fmaf(og, qsv[c], srun[ri][c]));
        }
      }
    };
    if constexpr (kRun) {
#pragma unroll
      for (int ri = 0; ri < 2; ++ri)
#pragma unroll
        for (int c = 0; c < NC; ++c) srun[ri][c] = 0.f;
    }
    {
      // ldmatrix batches: NBC of content (two 16-byte chunks each), then RoPE; each batch's ldmatrix is issued one
      // batch ahead, before the unpacking and the wgmma of the batch before it (in program order the asm statements
      // stay where they are: issued right after the wgmma wait, each ldmatrix stalled its first use for its whole
      // latency, ncu 2026-12-01: ~20% of the stall samples)
      const int mi = lane >> 3;
      const int tok = 16 * warp + 8 * (mi & 1) + (lane & 7);
      constexpr int NBC = CX / 2, NB = NBC + RCH / 2;
      // (QMLA_SM90_ADDR_BASES: the content addresses from four bases -- (2j + b) ^ l for l < 8 is 8 (j / 4) +
      // ((2 (j % 4) + b) ^ l) -- plus constants, instead of the swizzle recomputed for every batch)
      uint32_t qk_base[4];
      if constexpr (QMLA_SM90_ADDR_BASES) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          qk_base[k] = st_u + C::C_SM + tok * C::CBYTES + 16 * ((2 * k + (mi >> 1)) ^ (lane & 7));
      }
      auto qk_addr = [&](int j) -> uint32_t {  // token g / g+8 of chunk 2j, then of chunk 2j + 1
        if (QMLA_SM90_ADDR_BASES && j < NBC) return qk_base[j % 4] + 128 * (j / 4);
        return j < NBC ? st_u + C::C_SM + tok * C::CBYTES + 16 * ((2 * j + (mi >> 1)) ^ (lane & 7))
                       : st_u + C::R_SM + (2 * (j - NBC) + (mi >> 1)) * (kPage * 16) + tok * 16;  // chunk-major
      };
      uint32_t Rn[kLdsmAhead][4];  // the next kLdsmAhead batches' ldmatrix (QMLA_SM90_LDSM_AHEAD)
#pragma unroll
      for (int a = 0; a < kLdsmAhead; ++a)
        if (a < NB) ldsm_x4(Rn[a][0], Rn[a][1], Rn[a][2], Rn[a][3], qk_addr(a));
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        constexpr int kA = kLdsmAhead;
        uint32_t R[4] = {Rn[j % kA][0], Rn[j % kA][1], Rn[j % kA][2], Rn[j % kA][3]};
        if (j + kA < NB) ldsm_x4(Rn[j % kA][0], Rn[j % kA][1], Rn[j % kA][2], Rn[j % kA][3], qk_addr(j + kA));
        if constexpr (kRun && !kOneAcc) {  // first batch of content group gr >= 2 or of RoPE (gr = 4): gr - 2 is done
          constexpr int BPG = CPG / 2;  // batches per content group (2 chunks each)
          const int gr = j < NBC ? 2 * j / CPG : 4;
          if ((j < NBC ? (2 * j) % CPG == 0 : j == NBC) && gr >= 2) {
            if constexpr (kQkDepth > BPG) wgmma_wait<BPG>();  // (group gr - 2's last batch is BPG + 1 batches back)
            fold(gr - 2);
            init_acc(gr);
          }
        }
        if (j < NBC) {
          const int x = 2 * j;
          uint32_t a[2][F][4];
          score_a<CB, kSub>(R, a);
          wgmma_fence();
#pragma unroll
          for (int hx = 0; hx < 2; ++hx) {
            const int xx = x + hx, gr = xx / CPG, c = xx % CPG;
#pragma unroll
            for (int pl = 0; pl < F; ++pl)
              product_f16<kAblateScore, NH>(sacc[slot(gr)], a[hx][pl], qdesc.at((8 * gr + c * F + pl) * kKBlock),
                                            qdesc.hi);
          }
          wgmma_commit();
          wgmma_wait<kQkDepth>();  // the batches before these are done: their A registers are free
        } else {
          const int x = 2 * (j - NBC);
          uint32_t a[2][RF][4];
          score_a<RB, kSub>(R, a);
          wgmma_fence();
#pragma unroll
          for (int hx = 0; hx < 2; ++hx)
#pragma unroll
            for (int pl = 0; pl < RF; ++pl)
              product_f16<kAblateScore, NH>(sacc[slot(4)], a[hx][pl], qdesc.at((32 + (x + hx) * RF + pl) * kKBlock),
                                            qdesc.hi);
          if (x + 2 < RCH) {
            wgmma_commit();
            wgmma_wait<kQkDepth>();
          }
        }
      }
    }
    wgmma_commit();
    wgmma_wait<0>();  // also the previous tile's output product: O and the P tiles are free
    if constexpr (kRun) {
      fold(3);
      fold(4);
    } else {
#pragma unroll
      for (int gr = 0; gr < 5; ++gr) fence_operands(sacc[gr]);
    }
#pragma unroll
    for (int i = 0; i < 2 * NG; ++i) fence_operands(oacc[i]);

    // ---- (2) scores of this thread's tokens 16w + g + 8 ri and head columns c
    float sc[2][NC];
    bool tok_ok[2] = {true, true};
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      if (edge) tok_ok[ri] = tau >= tok_lo && tau < tok_hi;
      if constexpr (!kMetaOnce) load_meta<CSYM, RSYM, M>(meta, tau, ri, sv, ov, rsv, rov);
      if constexpr (kRun) {
#pragma unroll
        for (int c = 0; c < NC; ++c) sc[ri][c] = tok_ok[ri] ? srun[ri][c] : -INFINITY;
      } else {
        const float rs = rsv[ri], ro = rov[ri];
        float qsv[5][NC];
#pragma unroll
        for (int gr = 0; gr < 5; ++gr) load_row<NC>(qsv[gr], qb + 5 * NH + gr * NH + t * NC);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const float s4 = sacc[slot(4)][acc_idx(ri, c)];
          float s = RSYM ? rs * s4 : fmaf(rs, s4, ro * qsv[4][c]);
#pragma unroll
          for (int gr = 0; gr < 4; ++gr)
            s += CSYM ? sv[gr][ri] * sacc[slot(gr)][acc_idx(ri, c)]
                      : fmaf(sv[gr][ri], sacc[slot(gr)][acc_idx(ri, c)], ov[gr][ri] * qsv[gr][c]);
          sc[ri][c] = tok_ok[ri] ? s : -INFINITY;
        }
      }
    }
    float k_scale = 1.f;  // fp16 output: 2^(new k - old k) for the accumulators
    float mt[NC];
    bool need[NC], any = false;
    auto exchange = [&]() {
      heads_max_to(red, sc, warp, g, t);  // tile maximum per head: over g (lanes), then over the four warps
      if constexpr (kF16Out) warp_max_scale_to<NPT>(smx, sv, tok_ok, warp, lane);  // (mla_swapab.cuh)
      __syncthreads();
      if constexpr (kF16Out) k_scale = p_exponent(smx, k_run, k_set);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float4 m4 = head_row(red, c, t);
        mt[c] = fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w)) * two_e;
        need[c] = mt[c] > m_run[c] + kLazy;  // false for an empty tile (-inf)
        any |= need[c];
      }
    };
    if constexpr (kVote) {  // QMLA_SM90_VOTE (mla_sm90_cfg.cuh): exchange only when a vote says something moves
      if ((it & 7) == 0 || (kF16Out && !k_set) ||
          __syncthreads_or(vote_moves<NPT, kF16Out>(sc, sv, tok_ok, m_run, two_e, k_run)))
        exchange();
      else
#pragma unroll
        for (int c = 0; c < NC; ++c) {  // the running maximum and k stay: nothing to rescale
          need[c] = false;
          mt[c] = m_run[c];
        }
    } else {
      exchange();
    }
    if (__any_sync(0xffffffffu, any) || k_scale != 1.f) {
      float alpha[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float m_new = need[c] ? mt[c] : m_run[c];
        alpha[c] = need[c] ? ex2(m_run[c] - m_new) : 1.f;  // 0 from -inf
        m_run[c] = m_new;
        l_run[c] *= alpha[c];
#pragma unroll
        for (int gi = 0; gi < NPT; ++gi) po[gi][c] *= alpha[c];
      }
#pragma unroll
      for (int i = 0; i < 2 * NG; ++i)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri)
#pragma unroll
          for (int c = 0; c < NC; ++c) oacc[i][acc_idx(ri, c)] *= alpha[c] * k_scale;
    }
    // P; bf16(P s_g)^T into the B tiles of the output product (k-step = warp, k-half = ri); sum_t P o_g per thread
    float pv[2][NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float ms = m_run[c] == -INFINITY ? 0.f : m_run[c];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        pv[ri][c] = ex2(fmaf(sc[ri][c], two_e, -ms));
        l_run[c] += pv[ri][c];
      }
    }
    const float p_up = kF16Out ? exp2i(k_run) : 1.f;  // fp16 output: P s 2^k_run (exact scaling, then fp16 rounding)
    write_p_tiles<C, CB, NH, NPT, CSYM, kF16Out>(smem + C::PT, pv, sv, ov, tok_ok, p_up, po, warp, lane);
    // 4/2 bits: the output product's first ldmatrix (codes staged since the tile began) before the P barrier
    const int mi_v = lane >> 3;
    auto pv_addr = [&](int j) -> uint32_t {  // tokens (2t, 2t+1) / (8+2t, 9+2t) of k-step 2kp, then of 2kp + 1
      const int gi = j / 2, kp = j % 2, chunk = gi * CPG + (warp % CPG);
      const int tok = 16 * (2 * kp + (mi_v >> 1)) + 8 * (mi_v & 1) + (lane & 7);
      return st_u + C::C_SM + tok * C::CBYTES + 16 * (chunk ^ (lane & 7));
    };
    uint32_t Rv[kLdsmAhead][4];
    if constexpr (!kC8) {
#pragma unroll
      for (int a = 0; a < kLdsmAhead; ++a) ldsm_x4_t(Rv[a][0], Rv[a][1], Rv[a][2], Rv[a][3], pv_addr(a));
    }
    if constexpr (kLateCopy) cp_async_wait<0>();  // page it + 1, the one copy in flight, lands before the barrier
    fence_proxy_async();
    __syncthreads();
    if constexpr (kLateCopy) next_copy(it, pg);  // into the stage tile it - 1 read: every warp is past it now

    // ---- (3) output product: O_(g,h)^T += codes^T (bf16, exact) x bf16(P s_g)^T, 4 k-steps of 16 tokens
#pragma unroll
    for (int i = 0; i < 2 * NG; ++i) fence_operands(oacc[i]);
    if constexpr (kC8)
      pv_product_c8<C, NH, kSub>(oacc, st_u, pdesc, warp, lane);
    else
      pv_product_packed<CB, C, NH, kF16Out, kTS, kSub, kLdsmAhead>(oacc, Rv, vshift, pv_addr, pdesc);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 2 * NG; ++i) fence_operands(oacc[i]);

  // ---- epilogue: row sums and offset sums over g and the four warps; normalized partial output, log2-sum-exp
  __syncthreads();
  heads_sum_to(red, l_run, warp, g, t);
#pragma unroll
  for (int gi = 0; gi < NPT; ++gi) heads_sum_to(roff + gi * kHeads * 4, po[gi], warp, g, t);
  __syncthreads();
  float inv_l[NC], corr[NG][NC];
  // 2^-k_run (fp16 output product); kSub: times 2^24 and, per accumulator half hh, 2^-(CB hh) (its plane's factor)
  const float o_down[2] = {kF16Out ? exp2i(kSub ? 24 - k_run : -k_run) : 1.f,
                           kF16Out ? exp2i(kSub ? 24 - k_run - (kC8 ? 0 : CB) : -k_run) : 1.f};
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int h = head_of(c, t);
    const float l = head_total(red, c, t);
    inv_l[c] = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) corr[gi][c] = head_total(roff + (kTS ? 0 : gi) * kHeads * 4, c, t);
    if (warp == 0 && g == 0 && h0 + h < p.H)
      p.pl[row0 + h0 + h] = l > 0.f ? m_run[c] + log2f(l) : -INFINITY;
  }
  store_partial<kC8, CPG, PS, NG, NC, NH>(p.po, row0, p.H, h0, oacc, o_down, corr, inv_l, warp, g, t);
#if QMLA_PDL
  if (p.pdl_late) pdl_wait();  // this grid completes after the buffer kernel: the merge's wait then covers both
#endif
#if QMLA_FUSED_MERGE  // the last CTA of (b, hg) merges the splits (its flag: smx, free since the loop)
  if (p.arrivals) merge_in_kernel<kHeads, kThreads>(p, b, hg, h0, reinterpret_cast<int*>(smx));
#endif
#endif
}

// The kernel family for mla_launch.cuh.
struct WgmmaKernel {  // packed pages (C4R4, C2R4, C8R8, C4R8) and BF16 pages (bits 16/16: mla_sm90_bf16.cuh)
  static constexpr int kThreads = sm90::kThreads;
  template <int CB, int RB>
  static constexpr bool has =
      (RB == 4 && (CB == 2 || CB == 4)) || (RB == 8 && (CB == 4 || CB == 8)) || (CB == 16 && RB == 16);
  template <int CB, int RB>  // C4R4T / C2R4T (one content scale per token)
  static constexpr bool has_token_scale =
      RB == 4 && (CB == 2 || CB == 4) && QMLA_SM90_SCORE_RUN >= 1 && QMLA_SM90_META_ONCE;
  // 16 heads per CTA. (The NH = 32 pair path -- two CTAs sharing a 32-head group, each running the output product of
  // two content groups -- ran correctly on the H200 but slower than 16-head CTAs at 64 / 128 heads, 162 / 266 vs
  // 135 / 231 us at B1 x 128K, results/decode_vs_flashmla_h200_heads32.md: it is no longer instantiated; past 16 heads
  // auto takes these 16-head CTAs or the ws kernel, decode_mla_sm90_ws.cu.)
  static int heads_per_cta(int, int) { return 16; }
  static int head_ctas(int H, int) { return (H + 15) / 16; }
  template <int CB, int RB>
  static int smem(int) {
    if constexpr (CB == 16) return Bf16Cfg::SMEM;
    else return Cfg<CB, RB, 16>::SMEM;
  }
  template <int CB, int RB, bool CSYM, bool RSYM>
  static KernelFn fn(int) {
    if constexpr (CB == 16) return decode_kernel_sm90_bf16;
    else return decode_kernel_sm90<CB, RB, CSYM, RSYM, 16>;
  }
  template <int CB, int RB>
  static KernelFn fn_ts(int) {
    return decode_kernel_sm90<CB, RB, false, false, 16, true>;
  }
};

}  // namespace sm90

template <>  // with QMLA_PDL the packed page kernel is a programmatic launch: it waits for the kernel before it
struct ProgrammaticLaunch<sm90::WgmmaKernel> {  // (the buffer kernel at its end, any other at its start) itself
  static constexpr bool value = QMLA_PDL;
};

// 1 when the library launches programmatically (QMLA_PDL): cuda_decode.py then runs the buffer kernel on the same
// stream just before the page kernel (Params::pdl_late) instead of on a side stream, so that nothing joins
// between the page kernel and the merge.
extern "C" int qmla_pdl() { return QMLA_PDL; }

// 1 when the page kernel can merge the splits itself (mla_fused_merge.cuh; cuda_decode.py decides where it does).
extern "C" int qmla_fused_merge() { return QMLA_FUSED_MERGE; }
}  // namespace qmla

// The same C entry points as decode_mla.cu (a separate library); grid (head_ctas(H), splits, B).
QMLA_EXPORT_DECODE(qmla::sm90::WgmmaKernel)
