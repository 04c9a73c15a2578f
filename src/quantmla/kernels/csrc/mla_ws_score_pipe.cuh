// The score warpgroup of the warp-specialized decode kernel, software-pipelined across pages (QMLA_WS_PIPE=1, the
// "ws2" library decode_mla_sm90_ws2.cu; the baseline is mla_ws_score.cuh, whose per-tile math this reuses unchanged).
//
// Why (ncu of ws, 2026-12-01, docs/kernels.md): the score warpgroup is the critical path -- it never waits for data
// (its full[] and pempty[] waits never spun) while the output warpgroups spin on pfull[] 45% of their time -- and it
// issues one instruction per ~3.4 cycles: one warp per scheduler running the product, the combination, the softmax
// and the P stores of a page one after the other, each a chain of dependent instructions with nobody to hide their
// latency. Here the second half of page i (the softmax after the tile-max exchange, the P s_g tiles) is interleaved
// with the score product of page i + 1 in one basic block, so the product's unpacking (LOP3/SHF) and asynchronous
// wgmma fill the softmax's latency and vice versa. Live across the overlap: page i + 1's five accumulators (80
// registers) beside page i's 16 probabilities; page i's scores are collapsed before, its meta re-read from its stage
// (still resident: the output warpgroups refill it only after pfull[i]).
//
// Order per iteration i (the first page's product and combination run before the loop):
//   named barrier (page i's tile maxima) -> wait full[i + 1] -> wait pempty[i % 2] (i >= 2) -> lazy-maximum decision,
//   rescale factors -> { product of page i + 1, batch j } x 9 with, after batch 0, P = 2^(S - m) of page i and, after
//   batch 1 + gi, the (P s_gi 2^k)^T stores of page i; after batch 4 fence + arrive pfull[i % 2] -> combination and
//   tile maxima of page i + 1.
// QMLA_WS_PIPE=2 ("ws3", decode_mla_sm90_ws3.cu): page i's P work after batches 0-3, and page i + 1's combination
// split by group into the overlap too (groups 0, 1, 2 after batches 4, 5, 7; group 3 and RoPE after the product).
// The mbarrier protocol is the baseline's with the score warpgroup's full[i + 1] wait moved before its pfull[i]
// arrival (no deadlock: page i + 1's copy needs only pfull[i + 1 - kStages], arrived earlier; the CPU check
// test_cuda_compile.py::test_ws_pipeline_protocol_has_no_race_or_deadlock runs this order too).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_swapab.cuh"
#include "mla_wgmma.cuh"
#include "mla_ws_cfg.cuh"

namespace qmla {
namespace ws {

// The score product of the page staged at st_u into sacc (2^-e units; group 4 = RoPE), the accumulators started from
// the q-side terms in qb; after(j) runs after batch j's wgmma were issued (the code the compiler interleaves).
template <int CB, int RB, typename After>
__device__ __forceinline__ void ws_score_product(float (&sacc)[5][kNH / 2], uint32_t st_u, const Desc& qdesc,
                                                 const float* qb, int warp, int lane, int t, After&& after) {
  using C = Cfg<CB, RB>;
  constexpr int NH = kNH, NC = C::NC, KB = C::KB, F = C::F, CPG = C::CPG, CX = C::CBYTES / 16;
  constexpr int RF = C::RF, RCH = C::RCH;
#pragma unroll
  for (int gr = 0; gr < 5; ++gr) {
    float iv[NC];
    load_row<NC>(iv, qb + gr * NH + t * NC);
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) sacc[gr][acc_idx(ri, c)] = iv[c];
    fence_operands(sacc[gr]);
  }
  const int mi = lane >> 3;
  const int tok = 16 * warp + 8 * (mi & 1) + (lane & 7);
  constexpr int NBC = CX / 2, NB = NBC + RCH / 2;
  auto qk_addr = [&](int j) -> uint32_t {  // token g / g+8 of chunk 2j, then of chunk 2j + 1
    return j < NBC ? st_u + C::C_SM + tok * C::CBYTES + 16 * ((2 * j + (mi >> 1)) ^ (lane & 7))
                   : st_u + C::R_SM + (2 * (j - NBC) + (mi >> 1)) * (kPage * 16) + tok * 16;  // chunk-major
  };
  // the codes two batches ahead (ptxas hoists each batch's unpacking above the wgmma of the batch before, so one
  // batch ahead left 5-20 instructions between an ldmatrix and its first use: the ncu samples' short-scoreboard
  // stalls on the first SHF of a batch, ~15% of the baseline's product phase)
  constexpr int AHEAD = QMLA_WS_LDSM_AHEAD;
  static_assert(AHEAD >= 1 && AHEAD <= 2, "ldmatrix prefetch depth");
  uint32_t Rn[AHEAD][4];
#pragma unroll
  for (int j = 0; j < AHEAD; ++j) ldsm_x4(Rn[j][0], Rn[j][1], Rn[j][2], Rn[j][3], qk_addr(j));
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    uint32_t R[4] = {Rn[j % AHEAD][0], Rn[j % AHEAD][1], Rn[j % AHEAD][2], Rn[j % AHEAD][3]};
    if (j + AHEAD < NB)
      ldsm_x4(Rn[j % AHEAD][0], Rn[j % AHEAD][1], Rn[j % AHEAD][2], Rn[j % AHEAD][3], qk_addr(j + AHEAD));
    if (j < NBC) {
      const int x = 2 * j;
      uint32_t a[2][F][4];
      score_frags<CB>(R, a);
      wgmma_fence();
#pragma unroll
      for (int hx = 0; hx < 2; ++hx) {
        const int xx = x + hx, gr = xx / CPG, c = xx % CPG;
#pragma unroll
        for (int pl = 0; pl < F; ++pl)
          wgmma_f16_n32(sacc[gr], a[hx][pl], qdesc.at((8 * gr + c * F + pl) * KB), qdesc.hi);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the batch before this one is done: its A registers are free
    } else {
      const int x = 2 * (j - NBC);
      uint32_t a[2][RF][4];
      score_frags<RB>(R, a);
      wgmma_fence();
#pragma unroll
      for (int hx = 0; hx < 2; ++hx)
#pragma unroll
        for (int pl = 0; pl < RF; ++pl)
          wgmma_f16_n32(sacc[4], a[hx][pl], qdesc.at((32 + (x + hx) * RF + pl) * KB), qdesc.hi);
      if (x + 2 < RCH) {
        wgmma_commit();
        wgmma_wait<1>();
      }
    }
    after(j);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int gr = 0; gr < 5; ++gr) fence_operands(sacc[gr]);
}

template <int CB, int RB, bool CSYM, bool RSYM>
__device__ __forceinline__ void score_role_pipe(const Params& p, uint8_t* smem, int e, int pg0, int pg1, int lo,
                                                int hi, int h0) {
  using C = Cfg<CB, RB>;
  using M = MetaRows<CSYM, RSYM>;
  constexpr int NH = kNH, NC = C::NC, NG = 4;
  constexpr int kStageBytes = (C::STAGE + 127) / 128 * 128;
  constexpr bool kSplit = QMLA_WS_PIPE >= 2;  // "ws3": the next page's combination split into the overlap too
  const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id(), g = lane >> 2, t = lane & 3;
  const float* qb = reinterpret_cast<const float*>(smem + C::QB);
  const float two_e = exp2i(e);
  const Desc qdesc(wgmma_desc(smem_u32(smem + C::QT), 128, 256));
  const uint32_t mbar = smem_u32(smem + C::MBAR);  // full[kStages], pfull[2], pempty[2]
  const uint32_t st0 = smem_u32(smem + C::ST);
  auto meta_of = [&](int it) {
    return reinterpret_cast<const __half*>(smem + C::ST + (it % kStages) * kStageBytes + C::M_SM);
  };

  float m_run[NC], l_run[NC], po[NG][NC];
  int k_run = 0;
  bool k_set = false;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    m_run[c] = -INFINITY;
    l_run[c] = 0.f;
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) po[gi][c] = 0.f;
  }

  // page it's scores (2^-e units) of this thread's tokens 16 warp + g + 8 ri, its tile maxima into RED / SMX buffer
  // it % 2 (the mla_ws_score.cuh step (2), unchanged)
  float sc[2][NC];
  bool tok_ok[2];
  auto combine = [&](const float (&sacc)[5][NH / 2], int it) {
    const int pg = pg0 + it, tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;
    const bool edge = tok_lo > 0 || tok_hi < kPage;
    const __half* meta = meta_of(it);
    float sv[4][2], ov[4][2], rsv[2], rov[2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      tok_ok[ri] = !edge || (tau >= tok_lo && tau < tok_hi);
      load_meta<CSYM, RSYM, M>(meta, tau, ri, sv, ov, rsv, rov);
    }
    float qs[NC];
    load_row<NC>(qs, qb + 5 * NH + 4 * NH + t * NC);
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int ri = 0; ri < 2; ++ri)
        sc[ri][c] = RSYM ? rsv[ri] * sacc[4][acc_idx(ri, c)] : fmaf(rsv[ri], sacc[4][acc_idx(ri, c)], rov[ri] * qs[c]);
#pragma unroll
    for (int gr = 0; gr < 4; ++gr) {
      load_row<NC>(qs, qb + 5 * NH + gr * NH + t * NC);
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          if (!CSYM) sc[ri][c] = fmaf(ov[gr][ri], qs[c], sc[ri][c]);
          sc[ri][c] = fmaf(sv[gr][ri], sacc[gr][acc_idx(ri, c)], sc[ri][c]);
        }
    }
    if (edge) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) sc[ri][c] = tok_ok[ri] ? sc[ri][c] : -INFINITY;
    }
    float* red = reinterpret_cast<float*>(smem + C::RED) + (it & 1) * NH * 4;  // [head][warp], double-buffered
    float* smx = reinterpret_cast<float*>(smem + C::SMX) + (it & 1) * 4;
    heads_max_to(red, sc, warp, g, t);
    float sm = 0.f;  // the tile's largest content scale (out-of-range tokens' meta may be anything: skipped)
#pragma unroll
    for (int gr = 0; gr < 4; ++gr)
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) sm = tok_ok[ri] ? fmaxf(sm, fabsf(sv[gr][ri])) : sm;
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) sm = fmaxf(sm, __shfl_xor_sync(0xffffffffu, sm, o));
    if (lane == 0) smx[warp] = sm;
  };

  // QMLA_WS_PIPE=2 ("ws3"): the combination of page it + 1 split by group, each group folded in as soon as its
  // accumulator is complete (after the wgmma_wait<1> two batches after its last one), inside the overlap; only
  // group 3 and RoPE after the product. Same terms as combine(), summed in another order (RoPE last).
  float smx_run = 0.f;
  auto comb_begin = [&](int it) {
    const int pg = pg0 + it, tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;
    const bool edge = tok_lo > 0 || tok_hi < kPage;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      tok_ok[ri] = !edge || (tau >= tok_lo && tau < tok_hi);
#pragma unroll
      for (int c = 0; c < NC; ++c) sc[ri][c] = 0.f;
    }
    smx_run = 0.f;
  };
  auto comb_group = [&](float (&acc)[NH / 2], int it, int gr) {
    fence_operands(acc);  // complete: after the wgmma_wait that covers its last batch
    const __half* meta = meta_of(it);
    float qs[NC];
    load_row<NC>(qs, qb + 5 * NH + gr * NH + t * NC);
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      const float sv = __half2float(meta[(M::CS + gr) * kPage + tau]);
      const float ov = CSYM ? 0.f : __half2float(meta[(M::CO + gr) * kPage + tau]);
      smx_run = tok_ok[ri] ? fmaxf(smx_run, fabsf(sv)) : smx_run;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        if (!CSYM) sc[ri][c] = fmaf(ov, qs[c], sc[ri][c]);
        sc[ri][c] = fmaf(sv, acc[acc_idx(ri, c)], sc[ri][c]);
      }
    }
  };
  auto comb_end = [&](const float (&acc)[NH / 2], int it) {  // RoPE, the mask, the tile maxima (as combine())
    const int pg = pg0 + it, tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;
    const bool edge = tok_lo > 0 || tok_hi < kPage;
    const __half* meta = meta_of(it);
    float qs[NC];
    load_row<NC>(qs, qb + 5 * NH + 4 * NH + t * NC);
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int tau = 16 * warp + g + 8 * ri;
      const float rs = __half2float(meta[M::RS * kPage + tau]);
      const float ro = RSYM ? 0.f : __half2float(meta[M::RO * kPage + tau]);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        if (!RSYM) sc[ri][c] = fmaf(ro, qs[c], sc[ri][c]);
        sc[ri][c] = fmaf(rs, acc[acc_idx(ri, c)], sc[ri][c]);
        if (edge) sc[ri][c] = tok_ok[ri] ? sc[ri][c] : -INFINITY;
      }
    }
    float* red = reinterpret_cast<float*>(smem + C::RED) + (it & 1) * NH * 4;
    float* smx = reinterpret_cast<float*>(smem + C::SMX) + (it & 1) * 4;
    heads_max_to(red, sc, warp, g, t);
    float sm = smx_run;
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) sm = fmaxf(sm, __shfl_xor_sync(0xffffffffu, sm, o));
    if (lane == 0) smx[warp] = sm;
  };

  const int n = pg1 - pg0;
  if (n > 0) {
    float sacc[5][NH / 2];
    mbar_wait(mbar, full_parity(0));
    ws_score_product<CB, RB>(sacc, st0, qdesc, qb, warp, lane, t, [](int) {});
    combine(sacc, 0);
  }
  for (int it = 0; it < n; ++it) {
    const int pb = it & 1;
    const bool more = it + 1 < n;
    named_sync(kBarScore, kWg);  // page it's tile maxima are in RED / SMX buffer pb
    if (more) mbar_wait(mbar + 8 * ((it + 1) % kStages), full_parity(it + 1));
    if (it >= 2) mbar_wait(mbar + 8 * (kStages + 2 + pb), pempty_parity(it));  // P buffer pb: tile it - 2 done

    // ---- the lazy-maximum decision of page it (mla_ws_score.cuh step (2), second half)
    const float* red = reinterpret_cast<const float*>(smem + C::RED) + pb * NH * 4;
    const float* smx = reinterpret_cast<const float*>(smem + C::SMX) + pb * 4;
    float k_scale = 1.f;  // 2^(new k - old k) for the accumulators
    {
      const float sm = fmaxf(fmaxf(smx[0], smx[1]), fmaxf(smx[2], smx[3]));
      if (sm > 0.f && sm <= 65504.f) {
        const int k_want = 6 - (((__float_as_int(sm) >> 23) & 0xff) - 127);  // 2^8 sm 2^k in [2^14, 2^15)
        if (!k_set) {
          k_run = k_want;
          k_set = true;
        } else if (k_want < k_run || k_want > k_run + 8) {
          k_scale = exp2i(k_want - k_run);
          k_run = k_want;
        }
      }
    }
    float mt[NC], alpha[NC];
    bool need[NC], any = false;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float4 m4 = head_row(red, c, t);
      mt[c] = fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w)) * two_e;
      need[c] = mt[c] > m_run[c] + kLazy;  // false for an empty tile (-inf)
      any |= need[c];
    }
    const bool rescale = __any_sync(0xffffffffu, any) || k_scale != 1.f;  // the same in every warp
#pragma unroll
    for (int c = 0; c < NC; ++c) alpha[c] = 1.f;
    if (rescale) {  // most tiles skip this (lazy maximum)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float m_new = need[c] ? mt[c] : m_run[c];
        alpha[c] = need[c] ? ex2(m_run[c] - m_new) : 1.f;  // 0 from -inf
        m_run[c] = m_new;
        l_run[c] *= alpha[c];
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) po[gi][c] *= alpha[c];
      }
    }
    float* alpha_out = reinterpret_cast<float*>(smem + C::ALPHA) + pb * NH;
    if (rescale && warp == 0 && g == 0) {
#pragma unroll
      for (int c = 0; c < NC; ++c) alpha_out[head_of(c, t)] = alpha[c] * k_scale;
    }
    if (tid == 0) reinterpret_cast<int*>(smem + C::ALPHA + 2 * NH * 4)[pb] = rescale;

    // ---- page it's probabilities and (P s_g 2^k)^T stores (mla_ws_score.cuh step (3)), as pieces for the product
    const float p_up = exp2i(k_run);  // P s 2^k_run in fp16 (exact scaling, then the fp16 rounding)
    const uint32_t p_row = smem_u32(smem + C::PT + pb * C::PTB) + p_store_row(warp, lane);
    const __half* meta = meta_of(it);
    float pv[2][NC];
    auto probs = [&]() {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float ms = m_run[c] == -INFINITY ? 0.f : m_run[c];
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          pv[ri][c] = ex2(fmaf(sc[ri][c], two_e, -ms));
          l_run[c] += pv[ri][c];
        }
      }
    };
    auto store_group = [&](int gi) {
      float s_[2], o_[2];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {  // an out-of-range token's meta may be anything (NaN): P = 0 is not enough
        const int tau = 16 * warp + g + 8 * ri;
        const float sv = __half2float(meta[(M::CS + gi) * kPage + tau]);
        const float ov = CSYM ? 0.f : __half2float(meta[(M::CO + gi) * kPage + tau]);
        s_[ri] = tok_ok[ri] ? sv * p_up : 0.f;
        o_[ri] = tok_ok[ri] ? (CSYM ? -(float)(1 << (CB - 1)) * sv : ov) : 0.f;
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) po[gi][c] = fmaf(pv[0][c], o_[0], fmaf(pv[1][c], o_[1], po[gi][c]));
#pragma unroll
      for (int q = 0; q < NC / 4; ++q) {
        uint32_t r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = 2 * q + i / 2, ri = i % 2;
          r[i] = pack_f16(pv[ri][2 * m] * s_[ri], pv[ri][2 * m + 1] * s_[ri]);
        }
        stsm_x4_t(p_row + p_store_step(gi, q), r[0], r[1], r[2], r[3]);
      }
    };
    auto publish = [&]() {
      fence_proxy_async();  // the generic-proxy writes, before the output warpgroups' wgmma read them
      mbar_arrive(mbar + 8 * (kStages + pb));
    };

    if (more) {  // page it + 1's product with page it's second half interleaved, then its combination
      float sacc[5][NH / 2];
      const uint32_t st_u = st0 + ((it + 1) % kStages) * kStageBytes;
      if constexpr (!kSplit) {
        ws_score_product<CB, RB>(sacc, st_u, qdesc, qb, warp, lane, t, [&](int j) {
          if (j == 0) probs();
          if (j >= 1 && j <= NG) store_group(j - 1);
          if (j == NG) publish();
        });
        combine(sacc, it + 1);  // overwrites sc / tok_ok: page it's are no longer needed
      } else {  // batch j covers chunks 2j, 2j + 1: group gr's last batch is 2 gr + 1, complete after batch 2 gr + 2's
        // wait; page it's P work in batches 0-3, then page it + 1's groups 0, 1, 2 after batches 4, 5, 7 (groups 0
        // and 1 both after batch 4 spilled 4 B with symmetric RoPE)
        static_assert(C::CPG == 4, "two batches per content group");
        ws_score_product<CB, RB>(sacc, st_u, qdesc, qb, warp, lane, t, [&](int j) {
          if (j == 0) probs();
          if (j <= 3) store_group(j);
          if (j == 3) publish();
          if (j == 4) {
            comb_begin(it + 1);  // overwrites sc / tok_ok: page it's are no longer needed
            comb_group(sacc[0], it + 1, 0);
          }
          if (j == 5) comb_group(sacc[1], it + 1, 1);
          if (j == 7) comb_group(sacc[2], it + 1, 2);
        });
        comb_group(sacc[3], it + 1, 3);
        comb_end(sacc[4], it + 1);
      }
    } else {
      probs();
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) store_group(gi);
      publish();
    }
  }

  // ---- epilogue: row sums and offset sums over g and the four warps -> FIN; log2-sum-exp (as mla_ws_score.cuh)
  float* lsum = reinterpret_cast<float*>(smem + C::LSUM);
  float* roff = reinterpret_cast<float*>(smem + C::ROFF);
  float* fin = reinterpret_cast<float*>(smem + C::FIN);  // [kNH] 1 / l, [4][kNH] offset terms, [1] 2^-k
  heads_sum_to(lsum, l_run, warp, g, t);
#pragma unroll
  for (int gi = 0; gi < NG; ++gi) heads_sum_to(roff + gi * NH * 4, po[gi], warp, g, t);
  named_sync(kBarScore, kWg);
  if (warp == 0 && g == 0) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int h = head_of(c, t);
      const float l = head_total(lsum, c, t);
      fin[h] = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) fin[NH + gi * NH + h] = head_total(roff + gi * NH * 4, c, t);
      // the partial-output row, recomputed here: kept live from the kernel's start across this role it spilled
      const long long row0 = ((long long)blockIdx.z * p.ns_total + blockIdx.y) * p.H;
      if (h0 + h < p.H) p.pl[row0 + h0 + h] = l > 0.f ? m_run[c] + log2f(l) : -INFINITY;
    }
  }
  if (tid == 0) fin[5 * NH] = exp2i(-k_run);
}

}  // namespace ws
}  // namespace qmla
