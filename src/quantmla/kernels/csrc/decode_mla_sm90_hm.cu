// Packed low-bit MLA decode attention for Hopper (sm_90a) with many heads: 64 heads on M, each page dequantized once
// per CTA by a producer warpgroup (kernel "hm"; layout, products, unpacking: mla_hm.cuh). auto's choice for C4R4 /
// C2R4 from 33 heads on (session 38, H100, C4R4: 1.33-1.40x FlashMLA BF16 at 64 heads and 0.73-0.81x at 128, where
// ws gives 0.74-0.77x / 0.41-0.44x; on the H200, session 37's build: 0.91-0.94x / 0.63-0.70x, the kernel being
// SM-bound and FlashMLA faster there; docs/kernels.md "Many heads on M with a producer warpgroup").
//
// Same contract, page layout, partial outputs and merge as the other kernels (decode_mla_sm90.cu's header); grid
// (ceil(H / 64), splits, B). Unlike them it dequantizes: the tile holds fp16 values s c + o (one rounding of the fused
// product, relative 2^-12), q is fp16(bf16(q qk_scale) 2^-e) with the CTA's exponent e (mla_query.cuh's rule), so the
// score product is one accumulator and the output product one m64n256k16 per 16 tokens: FlashMLA's consumer. (The
// exact form -- bf16 codes, scales on five group accumulators, the removed wgmma64 v2's math -- needs ~250 registers a
// consumer beside O's 128, which a producer warpgroup leaves no room for: measured offline, 1.8-3 KB of spills.)
//   WG 0, producer: per tile (one 64-token page) loads its thread's bytes of the page (all in flight before it waits
//     for the tile buffer to be free) and its token's scales and offsets, writes the 64 x 576 tile group by group
//     (zeros for tokens outside [lo, hi), whose bytes may be anything), arriving on full[group][buffer] after each.
//   WG 1 + c, consumer c: tiles 2k + c are its own (buffer c). Per iteration k: the score product of its own tile as
//     the groups land, mask, a lazy running maximum of its own, P = 2^(S - m) in fp16; the P of tile 2k goes from
//     consumer 0 to consumer 1 and that of 2k + 1 back through one P buffer (two named barriers); each consumer runs
//     the output product of its 256 channels over both tiles, the other's P rescaled into its own frame by
//     2^(m_other - m_own) <= 2^4 per row. QMLA_HM_EARLY (the default) orders the products by tile and releases each
//     buffer (empty[]) after its own output product: consumer 0 scores 2k, publishes, multiplies, releases buffer 0,
//     then takes P(2k + 1); consumer 1 takes P(2k), multiplies, releases buffer 0, then scores, publishes and
//     multiplies 2k + 1 -- so the producer refills buffer 0 while buffer 1 is still read. Row sums stay per consumer
//     (own tiles) and are joined at the end in each consumer's frame. The protocol: tests/kernels/test_hm_protocol.py.
// Formats: C4R4 and C2R4 (asymmetric or symmetric paths). Dequantized values must fit fp16 (|s c + o| < 65504).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_hm.cuh"
#include "mla_hm_query.cuh"
#include "mla_launch.cuh"
#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_wgmma.cuh"
#include "mla_ws_cfg.cuh"

#ifndef QMLA_HM_REG_PRODUCER  // setmaxnreg: producer / consumers (80 + 2 x 208 = 496 <= 504 = 3 x 168; session 38,
#define QMLA_HM_REG_PRODUCER 80  // for LDNEXT: no spills at any instantiation; session 37's 72 / 216 spilled LDNEXT's
#endif                           // producer 20-40 B)
#ifndef QMLA_HM_REG_CONSUMER
#define QMLA_HM_REG_CONSUMER 208
#endif
#ifndef QMLA_HM_TOKMAP  // 1: the producer's loads as 16 tokens x 32 contiguous bytes per warp instruction (the default
#define QMLA_HM_TOKMAP 1  // since session 37, with QVEC and mla_hm.cuh's INPLACE: 1.12-1.17x, H100); 0: 32 tokens x 16 B
#endif
#ifndef QMLA_HM_EARLY  // 1: a consumer releases each tile buffer as soon as its output product over that tile is done
#define QMLA_HM_EARLY 1  // (products ordered by tile, so the producer refills buffer 0 while buffer 1 is still read;
#endif                   // session 37: 1.13-1.20x); 0: both buffers released after both output products. (FlashMLA's
                         // order -- both consumers score at once, buffers released by halves -- was built in session
                         // 40 and measured 0.90-0.95x in session 42: removed; docs/kernels.md "Session 40")
#ifndef QMLA_HM_LDNEXT  // 1: the producer loads page it + 1 while it unpacks page it, into the registers each group has
#define QMLA_HM_LDNEXT 1  // just been unpacked from (ptxas sinks the content loads to the tile's end, the scales stay
#endif                    // spread; the default since session 38, with QREG 1.01-1.05x, H100); 0: at the page's start
#ifndef QMLA_HM_PRE  // 1 (with EARLY): a consumer issues the first score group of its next own tile before it waits for
#define QMLA_HM_PRE 0  // the other's P, so products run through that wait (session 38 ncu: each consumer ~43% of its
#endif                 // time there); the frame's O rescale is then branch-free (ptxas serializes wgmma otherwise).
                       // Measured (session 39, H100, C4R4, 64 heads, B32 x 32K): 0.96x -- a variant, not the default
#ifndef QMLA_HM_PREFETCH  // D > 0: the producer asks L2 for page it + D (one bulk prefetch) as it starts page it, so
#define QMLA_HM_PREFETCH 2  // more than one page per SM is in flight from DRAM (session 37: 1.03-1.05x alone, with
#endif                      // EARLY 1.22-1.28x over neither, H100); 0: none

namespace qmla {
namespace hm {

using ws::mbar_arrive;
using ws::mbar_init;
using ws::mbar_init_fence;
using ws::mbar_wait;
using ws::named_arrive;
using ws::named_sync;

constexpr int kBarPub0 = 1, kBarPub1 = 2, kBarEnd = 3;  // named barriers of the two consumers (256 threads)
constexpr float kLazyOther = 4.f;  // the other's P is taken into the own frame when its maximum is <= 2^4 above


// ---- producer: the pages of this split, tile it into buffer it & 1
template <int CB, int RB, bool CSYM, bool RSYM>
__device__ __forceinline__ void producer(uint8_t* smem, const Params& p, const int* bt, int pg0, int pg1, int lo,
                                         int hi) {
  using C = PageCfg<CB, RB>;
  using M = MetaRows<CSYM, RSYM>;
  constexpr int CX = C::CBYTES / 16;  // content chunks per token (C4: 16, C2: 8)
  constexpr int NCH = CX / 2;         // a thread's content chunks (two threads per token)
  constexpr int CPG = C::CPG;         // chunks per content group (C4: 4, C2: 2)
  static_assert(C::RCH == 2, "two RoPE chunks per token");
  constexpr int HPG = CPG / 2;        // a thread's chunks per content group
  static_assert(CPG == CB, "mla_hm.cuh's chunk maps");
  // the thread's token and half row: QMLA_HM_TOKMAP 1 gives a warp 16 tokens x both halves, so one load instruction
  // reads 16 whole 32-byte sectors (32 half-used ones with 32 tokens x one half) and each quarter-warp still stores
  // 8 tokens' rows of one octet (no bank conflict); the chunk maps (mla_hm.cuh) are the same
  const int lt = threadIdx.x;
  const int tok = QMLA_HM_TOKMAP ? 16 * (lt >> 5) + (lt & 15) : lt & 63;
  const int half = QMLA_HM_TOKMAP ? (lt >> 4) & 1 : lt >> 6;
  const uint32_t s0 = smem_u32(smem), bar = s0 + B_SM;
  // chunk maps (mla_hm.cuh): the half only adds 16 bytes to the source and two octets to the destination
  const uint32_t row_off = (tok >> 3) * 128 + (tok & 7) * 16 + chunk_octet<CB>(0, half) * kOct;
  uint4 w[NCH], wr;  // the thread's content chunks and RoPE chunk of a page
  __half sv[5], ov[5];  // the token's scale and offset per content group, then RoPE (symmetric: c - 2^(b-1))
  auto load_meta = [&](const uint8_t* page, int g) {  // the token's scale and offset of group g
    const __half* meta = reinterpret_cast<const __half*>(page + p.m_off);
    const int srow = g < 4 ? M::CS + g : M::RS, orow = g < 4 ? (CSYM ? -1 : M::CO + g) : (RSYM ? -1 : M::RO);
    sv[g] = meta[srow * kPage + tok];
    const __half zero_code = __float2half(-(float)(1 << ((g < 4 ? CB : RB) - 1)));
    ov[g] = orow >= 0 ? meta[orow * kPage + tok] : __hmul(sv[g], zero_code);
  };
  // group g's bytes, scale and offset of `page` (g < 4: chunks g HPG .. g HPG + HPG - 1 of the thread; 4: RoPE)
  auto load_group = [&](const uint8_t* page, int g) {
    if (g < 4) {
      const uint8_t* crow = page + p.c_off + tok * C::CBYTES + chunk_byte<CB>(0, half);
#pragma unroll
      for (int j = 0; j < HPG; ++j)
        w[g * HPG + j] = __ldg(reinterpret_cast<const uint4*>(crow + chunk_byte<CB>(g * HPG + j, 0)));
    } else {
      wr = __ldg(reinterpret_cast<const uint4*>(page + p.r_off + tok * C::RBYTES + 16 * half));
    }
    load_meta(page, g);
  };
  auto page_at = [&](int pg) { return p.pool + (long long)bt[pg] * p.page_bytes; };
#if QMLA_HM_LDNEXT
  if (pg0 < pg1)
#pragma unroll
    for (int g = 0; g < 5; ++g) load_group(page_at(pg0), g);
#endif
  for (int it = 0; pg0 + it < pg1; ++it) {
    const int pg = pg0 + it, b = it & 1;
#if QMLA_HM_PREFETCH > 0
    if (lt == 0 && pg + QMLA_HM_PREFETCH < pg1)  // page_bytes is a multiple of 16 (kernels/layout.py), as bulk needs
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(page_at(pg + QMLA_HM_PREFETCH)),
                   "r"((uint32_t)p.page_bytes)
                   : "memory");
#endif
#if QMLA_HM_LDNEXT
    // this page's bytes were loaded during the page before; the next page's are loaded group by group below, into
    // the registers each group has just been unpacked from (no more registers, a whole tile's unpacking of cover)
    const bool more = pg + 1 < pg1;
    const uint8_t* next = page_at(more ? pg + 1 : pg);
#else
    {  // all in flight before the buffer wait
      const uint8_t* page = page_at(pg);
      const uint8_t* crow = page + p.c_off + tok * C::CBYTES + chunk_byte<CB>(0, half);
#pragma unroll
      for (int i = 0; i < NCH; ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(crow + chunk_byte<CB>(i, 0)));
      wr = __ldg(reinterpret_cast<const uint4*>(page + p.r_off + tok * C::RBYTES + 16 * half));
#pragma unroll
      for (int g = 0; g < 5; ++g) load_meta(page, g);
    }
#endif
    if (it >= 2) mbar_wait(bar + empty_bar(b), empty_parity(it));
    const bool ok = pg * kPage + tok >= lo && pg * kPage + tok < hi;  // else zeros (the bytes may be NaN)
    const uint32_t row = s0 + T_SM + b * kTile + row_off;
#pragma unroll
    for (int g = 0; g < 5; ++g) {
      const __half2 s2 = __half2half2(ok ? sv[g] : __float2half(0.f));
      const __half2 o2 = __half2half2(ok ? ov[g] : __float2half(0.f));
      const uint32_t s2u = *reinterpret_cast<const uint32_t*>(&s2), o2u = *reinterpret_cast<const uint32_t*>(&o2);
      if (g < 4) {
#pragma unroll
        for (int j = 0; j < HPG; ++j)
          unpack_chunk<CB, C::PS>(row, chunk_octet<CB>(g * HPG + j, 0), w[g * HPG + j], s2u, o2u);
      } else {  // RoPE chunk `half`: channels 16 half (+ plane stride RPS) = octet 64 + 2 half
        unpack_chunk<RB, C::RPS>(row, kDc / 8, wr, s2u, o2u);
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mbar_arrive(bar + full_bar(g, b));
#if QMLA_HM_LDNEXT
      if (more) load_group(next, g);
#endif
    }
  }
}

// ---- consumer c
template <int c>
__device__ __forceinline__ void consumer(uint8_t* smem, const Params& p, int e, int pg0, int pg1, int lo, int hi,
                                         long long row0, int h0) {
  const int lt = threadIdx.x - kWg * (1 + c), warp = lt >> 5, lane = lt & 31, g8 = lane >> 2, t = lane & 3;
  const uint32_t s0 = smem_u32(smem), bar = s0 + B_SM;
  const int ntiles = pg1 - pg0;
  const float up = exp2i(e);  // scores are carried in 2^-e units
  float o[128];  // O of channels 256 c .. 256 c + 255 (m64n256 accumulator layout)
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float* frame = reinterpret_cast<float*>(smem + F_SM);

  auto rescale = [&](int v, float m_new) {  // the running maximum of row v moves to m_new
    const float a = ex2(m_run[v] - m_new);  // 0 from -inf
    m_run[v] = m_new;
    l_run[v] *= a;
#pragma unroll
    for (int i = 0; i < 128; ++i)
      if (((i >> 1) & 1) == v) o[i] *= a;
  };
  const Desc qd(wgmma_desc(s0 + Q_SM, kOct, 128));

  // groups [g0, g1) of the score product of tile 2k + c (buffer c) into s, each after it lands (g0 = 0 starts s;
  // wait_full false: the tile does not exist, the products read what the buffer holds and s is never used)
  auto score_issue = [&](float (&s)[32], int k, int g0, int g1, bool wait_full = true) {
    const Desc td(wgmma_desc(s0 + T_SM + c * kTile, kOct, 128));
    if (g0 == 0)
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
#pragma unroll
    for (int g = 0; g < 5; ++g) {
      if (g < g0 || g >= g1) continue;  // (constants after inlining)
      if (wait_full) mbar_wait(bar + full_bar(g, c), full_parity(k));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < (g < 4 ? 8 : 4); ++kk) {
        const int oc = g * 16 + 2 * kk;  // channel octet of this k-step
        wgmma_ss_n64(s, qd.at(oc * kOct), qd.hi, td.at(oc * kOct), td.hi, g > 0 || kk > 0);
      }
      wgmma_commit();
    }
  };
#if QMLA_HM_PRE
  float s_pre[32];  // the score accumulators of the next own tile, its first group issued ahead
#endif
  // the score product of tile 2k + c (this consumer's own, buffer c) from group g0 on (QMLA_HM_PRE: the groups before
  // g0 are already in s_pre) as its groups land; mask, lazy running maximum (rescales O: callers have no output
  // product in flight), P = 2^(S - m) in fp16 A fragments (the own frame)
  // softmax_own: the same from a score product s of tile 2k + c that is done
  auto softmax_own = [&](float (&s)[32], int k, uint32_t (&pa)[4][4]) {
    const int tok0 = (pg0 + 2 * k + c) * kPage;
    const bool edge = tok0 < lo || tok0 + kPage > hi;
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int tok = tok0 + 8 * (i >> 2) + 2 * t + (i & 1);
      s[i] = (edge & ((tok < lo) | (tok >= hi))) ? -INFINITY : s[i] * up;  // (bitwise: selects, no branches)
      mt[(i >> 1) & 1] = fmaxf(mt[(i >> 1) & 1], s[i]);
    }
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      mt[v] = fmaxf(mt[v], __shfl_xor_sync(0xffffffffu, mt[v], 1));
      mt[v] = fmaxf(mt[v], __shfl_xor_sync(0xffffffffu, mt[v], 2));
      if (mt[v] > m_run[v] + kLazy) rescale(v, mt[v]);
    }
    float pr[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int v = (i >> 1) & 1;
      pr[i] = ex2(s[i] - (m_run[v] == -INFINITY ? 0.f : m_run[v]));
      l_run[v] += pr[i];
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // a_r of k-step kk: row g8 + 8 (r & 1), tokens 16 kk + 8 (r >> 1) + 2t, + 1
        const int i = 4 * (2 * kk + (r >> 1)) + 2 * (r & 1);
        pa[kk][r] = pack_f16(pr[i], pr[i + 1]);
      }
  };
  auto score_own = [&](int k, uint32_t (&pa)[4][4], int g0 = 0) {
#if QMLA_HM_PRE
    float (&s)[32] = s_pre;
#else
    float s[32];
#endif
    score_issue(s, k, g0, 5);
    wgmma_wait<0>();
    fence_operands(s);
    softmax_own(s, k, pa);
  };
  // the P exchange through the one P buffer (P_SM, F_SM's maxima): publish the own P, take the other's
  auto publish = [&](const uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * warp + g8 + 8 * (r & 1), tok = 16 * kk + 8 * (r >> 1) + 2 * t;
        *reinterpret_cast<uint32_t*>(smem + P_SM + oct_offset(row, tok)) = pa[kk][r];
      }
    if (t == 0) frame[16 * warp + g8] = m_run[0], frame[16 * warp + g8 + 8] = m_run[1];
  };
  auto take = [&](uint32_t (&rp)[4][4], float (&fo)[2]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int mi = lane >> 3, row = 16 * warp + 8 * (mi & 1) + (lane & 7), tok = 16 * kk + 8 * (mi >> 1);
      ldsm_x4(rp[kk][0], rp[kk][1], rp[kk][2], rp[kk][3], s0 + P_SM + oct_offset(row, tok));
    }
    fo[0] = frame[16 * warp + g8], fo[1] = frame[16 * warp + g8 + 8];
  };
  // the other's P (its frame fo) into the own frame: the own maximum is raised first if the other's is far above it
  // (O rescaled: no output product in flight; the own P too where it is still to be used, own_live)
  auto frame_other = [&](bool own_live, uint32_t (&pa)[4][4], uint32_t (&rp)[4][4], const float (&fo)[2]) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const bool up = fo[v] > m_run[v] + kLazyOther;
#if QMLA_HM_PRE
      // branch-free (score products may be in flight here: ptxas serializes wgmma across a branch); O times 1 when
      // nothing moves. own_live is false at every call of the EARLY order, which QMLA_HM_PRE requires
      const float a = up ? ex2(m_run[v] - fo[v]) : 1.f;  // (0 from m_run = -inf)
      m_run[v] = up ? fo[v] : m_run[v];
      l_run[v] *= a;
#pragma unroll
      for (int i = 0; i < 128; ++i)
        if (((i >> 1) & 1) == v) o[i] *= a;
#else
      if (up) {
        if (own_live) {  // the own P, already in the old frame, moves with O
          const __half2 a2 = __float2half2_rn(ex2(m_run[v] - fo[v]));
          const uint32_t a2u = *reinterpret_cast<const uint32_t*>(&a2);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = v; r < 4; r += 2) asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(pa[kk][r]) : "r"(a2u));
        }
        rescale(v, fo[v]);
      }
#endif
      const float fr = fo[v] == -INFINITY ? 0.f : ex2(fo[v] - m_run[v]);  // (m_run >= fo - 4 is finite here)
      const __half2 f2 = __float2half2_rn(fr);
      const uint32_t f2u = *reinterpret_cast<const uint32_t*>(&f2);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = v; r < 4; r += 2) asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(rp[kk][r]) : "r"(f2u));
    }
  };
  // O (this consumer's 256 channels) += P V of the tile in buffer `buf`, read MN-major from channel 256 c (octet 32 c)
  auto out_product = [&](int buf, const uint32_t (&a)[4][4]) {
    const Desc vd(wgmma_desc(s0 + T_SM + buf * kTile + 32 * c * kOct, 128, kOct));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_n256_t(o, a[kk], vd.at(2 * kk * 128), vd.hi);
  };
  auto out_begin = [&]() {
    fence_operands(o);
    wgmma_fence();
  };
  auto out_end = [&]() {
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o);
  };
  auto out_tile = [&](int buf, const uint32_t (&a)[4][4]) {  // one tile's output product, waited for
    out_begin();
    out_product(buf, a);
    out_end();
  };

#if QMLA_HM_PRE
  static_assert(QMLA_HM_EARLY == 1, "QMLA_HM_PRE runs in the EARLY order");
  if (c == 0 && ntiles > 0) score_issue(s_pre, 0, 0, QMLA_HM_PRE);  // tile 0's first group
#endif
  for (int k = 0; 2 * k < ntiles; ++k) {
    const bool own = 2 * k + c < ntiles, other = 2 * k + (1 - c) < ntiles;
    uint32_t pa[4][4], rp[4][4];  // the own P (own frame), the other's (its frame fo[], then the own)
    float fo[2] = {-INFINITY, -INFINITY};
#if QMLA_HM_EARLY
    // products ordered by tile, each buffer released after its output product: consumer 0 scores tile 2k, publishes,
    // multiplies, releases buffer 0, then takes P(2k + 1) for buffer 1; consumer 1 takes P(2k) first, multiplies,
    // releases buffer 0, then scores, publishes and multiplies tile 2k + 1
    if (c == 0) {
      score_own(k, pa, QMLA_HM_PRE);  // (consumer 0 owns tile 2k whenever iteration k runs)
      publish(pa);
      named_arrive(kBarPub0, 2 * kWg);
      out_tile(0, pa);
      mbar_arrive(bar + empty_bar(0));
      if (other) {
#if QMLA_HM_PRE  // tile 2k + 2's first group (buffer 0), through the wait below; out_tile waits for it
        score_issue(s_pre, k + 1, 0, QMLA_HM_PRE, 2 * k + 2 < ntiles);
#endif
        named_sync(kBarPub1, 2 * kWg);
        take(rp, fo);
        frame_other(false, pa, rp, fo);
        out_tile(1, rp);
      }
      mbar_arrive(bar + empty_bar(1));
    } else {
#if QMLA_HM_PRE
      if (own) {  // tile 2k + 1's first group through the wait for P(2k) (out_tile waits for it). The whole iteration
                  // sits in this branch: products in flight past a branch's end make ptxas serialize wgmma (C7518)
        score_issue(s_pre, k, 0, QMLA_HM_PRE);
        named_sync(kBarPub0, 2 * kWg);
        take(rp, fo);
        frame_other(false, pa, rp, fo);
        out_tile(0, rp);
        mbar_arrive(bar + empty_bar(0));
        score_own(k, pa, QMLA_HM_PRE);
        publish(pa);
        named_arrive(kBarPub1, 2 * kWg);
        out_tile(1, pa);
        mbar_arrive(bar + empty_bar(1));
        continue;
      }
#endif
      named_sync(kBarPub0, 2 * kWg);
      take(rp, fo);
      frame_other(false, pa, rp, fo);
      out_tile(0, rp);
      mbar_arrive(bar + empty_bar(0));
      if (own) {
        score_own(k, pa);
        publish(pa);
        named_arrive(kBarPub1, 2 * kWg);
        out_tile(1, pa);
      }
      mbar_arrive(bar + empty_bar(1));
    }
#else
    if (own) score_own(k, pa);  // (O has no product in flight here)
    // consumer 0 publishes first, consumer 1 takes and publishes
    if (c == 0) {
      publish(pa);
      named_arrive(kBarPub0, 2 * kWg);
      if (other) {
        named_sync(kBarPub1, 2 * kWg);
        take(rp, fo);
      }
    } else {
      named_sync(kBarPub0, 2 * kWg);
      take(rp, fo);  // (consumer 1's "other" tile always exists: consumer 0 owns tile 2k)
      if (own) {  // consumer 0 waits for it only when this consumer has a tile
        publish(pa);
        named_arrive(kBarPub1, 2 * kWg);
      }
    }
    if (other) frame_other(own, pa, rp, fo);
    // output products of this consumer's 256 channels: the own tile, then the other's; both buffers released after
    out_begin();
    if (own) out_product(c, pa);
    if (other) out_product(1 - c, rp);
    out_end();
    mbar_arrive(bar + empty_bar(0));
    mbar_arrive(bar + empty_bar(1));
#endif
  }

  // ---- epilogue: row sums over the row's four lanes; join the two consumers' sums in each frame
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    l_run[v] += __shfl_xor_sync(0xffffffffu, l_run[v], 1);
    l_run[v] += __shfl_xor_sync(0xffffffffu, l_run[v], 2);
  }
  float* xch = reinterpret_cast<float*>(smem + P_SM);  // [2 consumers][64 rows][m, l]
  named_sync(kBarEnd, 2 * kWg);                        // every P read is done
  if (t == 0)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int row = 16 * warp + g8 + 8 * v;
      xch[(c * kNH + row) * 2] = m_run[v], xch[(c * kNH + row) * 2 + 1] = l_run[v];
    }
  named_sync(kBarEnd, 2 * kWg);
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const int row = 16 * warp + g8 + 8 * v, h = h0 + row;
    const float mo = xch[((1 - c) * kNH + row) * 2], lo_ = xch[((1 - c) * kNH + row) * 2 + 1];
    const float mf = m_run[v] == -INFINITY ? mo : m_run[v];  // this consumer's frame (the other's if it saw nothing)
    float L = l_run[v];
    if (lo_ > 0.f) L += lo_ * ex2(mo - mf);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    if (h < p.H) {
      if (c == 0 && t == 0) p.pl[row0 + h] = L > 0.f ? mf + log2f(L) : -INFINITY;
      float* out = p.po + (row0 + h) * kDc + 256 * c;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(out + 8 * j + 2 * t) =
            make_float2(o[4 * j + 2 * v] * inv, o[4 * j + 1 + 2 * v] * inv);
    }
  }
}

template <int CB, int RB, bool CSYM, bool RSYM>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel_hm(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ __align__(1024) uint8_t smem[];
  pdl_launch_dependents();
  const int hg = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / kWg, 0);  // warp-uniform for the compiler (setmaxnreg regions)
  const int h0 = hg * kNH;
  const int n = p.lens[b];
  const int lo = p.sink;
  const int hi = max(n - p.local, p.sink);
  const int pg0 = lo / kPage + sp * p.pps;
  const int pg1 = min(pg0 + p.pps, (hi + kPage - 1) / kPage);
  if (empty_split_leaves(p, pg0, pg1)) return;
  const int* bt = p.block_table + (long long)b * p.bt_stride;
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
  const uint32_t bar = smem_u32(smem + B_SM);
  if (tid == 0) {
    for (int g = 0; g < 5; ++g)
      for (int bf = 0; bf < 2; ++bf) mbar_init(bar + full_bar(g, bf), kWg);  // full[group][buffer]: the producer
    mbar_init(bar + empty_bar(0), 2 * kWg);                                 // empty[buffer]: both consumers
    mbar_init(bar + empty_bar(1), 2 * kWg);
    mbar_init_fence();
  }
  const int e = stage_q64(smem, p, b, h0);  // (its barriers publish the mbarrier inits too)
  if (wg == 0) {
    ws::regs_dec<QMLA_HM_REG_PRODUCER>();
    producer<CB, RB, CSYM, RSYM>(smem, p, bt, pg0, pg1, lo, hi);
  } else {
    ws::regs_inc<QMLA_HM_REG_CONSUMER>();
    if (wg == 1) consumer<0>(smem, p, e, pg0, pg1, lo, hi, row0, h0);
    else consumer<1>(smem, p, e, pg0, pg1, lo, hi, row0, h0);
  }
#endif
}

// The kernel family for mla_launch.cuh.
struct HmKernel {
  static constexpr int kThreads = hm::kThreads;
  template <int CB, int RB>
  static constexpr bool has = RB == 4 && (CB == 4 || CB == 2);
  template <int CB, int RB>
  static constexpr bool has_token_scale = false;
  static int heads_per_cta(int, int) { return kNH; }
  static int head_ctas(int H, int) { return (H + kNH - 1) / kNH; }
  template <int CB, int RB>
  static int smem(int) { return SMEM; }
  template <int CB, int RB, bool CSYM, bool RSYM>
  static KernelFn fn(int) {
    if constexpr (has<CB, RB>) return decode_kernel_hm<CB, RB, CSYM, RSYM>;
    else return nullptr;
  }
};

}  // namespace hm
}  // namespace qmla

// The same C entry points as decode_mla.cu (a separate library); grid (ceil(H / 64), splits, B).
QMLA_EXPORT_DECODE(qmla::hm::HmKernel)
