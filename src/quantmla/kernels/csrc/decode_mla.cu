// Packed low-bit MLA decode attention over the paged cache (quantmla.kernels.paged), CUDA C++ for sm_80+.
//
// One CTA = 4 warps = one (16-head group, split, sequence). Warp w owns content quantization group w
// (latent channels 128w .. 128w+127) for both products ("split-D"), so every per-token, per-group scale is a
// per-column scale of that warp's products and is applied to accumulators, never per element:
//
//   score:  S[h, t] = sum_g s_g[t] * (q_g . k_g[t]) + o'_g[t] * qsum_g[h]    (k = 128 + code, o' = o - 128 s)
//   output: O_g[h, :] = sum_t bf16(P[h,t] s_g[t]) c[t, :] + sum_t P[h,t] o_g[t]
//
// Codes reach the tensor cores (mma.sync m16n8k16, fp32 accumulate) exactly, as "magic numbers":
//   score product (fp16): a field becomes the fp16 number 1024 + 2^(b p) code, p = the field's plane, by one LOP3
//     (0x6400 = 1024; the fields of the upper byte of each 16-bit half after one shared 8-bit shift); q of plane
//     p carries 2^-(b p) (exact), and -1024 * sum(q) starts the accumulator, so it ends holding q . code;
//   output product (bf16): a field becomes 128 + code (one shift + one LOP3, 0x4300 = 128), minus 128 (one
//     bf16x2 FMA, exact): O accumulates over a whole split, and a 128 carried in its fp32 accumulators (row sums
//     subtracted once per tile instead) cost up to 4x the error at 128K tokens (C2R4: rel. L2 1.6e-2, H200).
// q is bf16(q * qk_scale) (the rounding the tests' reference uses), times 2^-e per CTA (e from its largest |q|, so
// the fp16 operands can neither overflow nor lose bits to subnormals), converted to fp16 exactly; scores are
// carried in 2^-e units until the softmax, whose exp2 takes 2^e in its FMA. The page's bytes are
// staged in shared memory with cp.async (2 stages); the SAME bytes are read with ldmatrix for the score product
// (B = K^T: pairs of channels of one token) and with ldmatrix.trans for the output product (B = V: pairs of
// tokens of one channel): a 16-bit element of a row holds 16/b codes of one token, and the grouped planar
// packing makes every 16-byte chunk of a row belong to one group. Chunk x of token n sits at
// 16 * (x ^ (n & 7)) in its shared-memory row (bank-conflict-free ldmatrix); RoPE chunks are stored
// chunk-major. Channel of field j of element e of group-chunk c: 16c + 2e + j / F + PS * (j % F), F = 8 / b
// codes per byte, PS = group / F (the plane stride of the grouped planar packing).
//
// Per 64-token tile: (1) each warp: its group's partial scores for all 64 tokens (64 mma), plus the RoPE
// scores of its own 16 tokens (8 mma); (2) partials through shared memory, every warp sums all four (one
// barrier) and runs the same online softmax on the full tile (the running maximum moves only when a tile's
// maximum exceeds it by more than kLazy: most tiles skip the rescaling of O); (3) each warp: P * s_g in bf16 as
// the A operand of its group's output product (64 mma into O, the codes as exact bf16 numbers c). Out-of-range tokens are masked (and their
// meta, which may be anything, zeroed) only in the tiles that have any. Writes the split's
// normalized partial output and its log2-sum-exp in the layout of the Triton kernels (quantmla/kernels/triton_decode.py), whose sink/local-buffer and combine kernels
// finish the attention.
//
// The torch reference of the same byte layout is the definition: quantmla/kernels/reference.py.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_launch.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"

namespace qmla {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kHeads = 16;   // heads per CTA (rows of the mma tiles)
constexpr int kStages = 2;
constexpr int kCtasPerSm = 3;  // __launch_bounds__: 168 registers

template <int CB>  // bits of a content code (2 or 4); RoPE codes are 4 bits
struct Cfg : PageCfg<CB> {
  using PageCfg<CB>::CPG;
  using PageCfg<CB>::F;
  using PageCfg<CB>::STAGE;
  static constexpr int PART = kWarps * 8 * 32 * 16;  // partial scores [warp][n-block][lane] float4
  static constexpr int QFRAG = (kWarps * CPG * F + 4) * 32 * 16;  // q A fragments [k-block][lane] uint4
  static constexpr int PFRAG = kWarps * kWarps * 32 * 16;  // P * s_g A fragments [group][slice][lane] uint4
  static_assert(PFRAG <= PART, "the P fragments reuse the partial-score buffer");
  static constexpr int SMALL = (kHeads * kWarps + kWarps * kHeads * kWarps) * 4;  // slice maxima, offset sums
  static constexpr int SMEM = kStages * STAGE + PART + QFRAG + SMALL;
  static constexpr int QSTAGE = kHeads * (kDc + kDr) * 2;  // bf16 q of the CTA's heads, once, in stage 1 + PART
  static_assert(kStages >= 2 && QSTAGE <= STAGE + PART, "q staging fits behind stage 0");
};

// fp16 A fragment of a 16-head x 16-channel block of q (plane p of a b-bit field: times 2^-(b p)) from the
// staged bf16 q [head][576]: a0 (h=g, k=2t,2t+1), a1 (g+8), a2 (g, 2t+8,2t+9), a3 (g+8). qm += the fp16 values
// as used (for the magic-number term), qs += them times 2^(b p) (q . 1 in 2^-e units, for the offset term).
template <int PS, int B>
__device__ __forceinline__ void load_qfrag(uint32_t (&a)[4], float (&qm)[2], float (&qs)[2], const __nv_bfloat16* qst,
                                           int ch0, int c, int p, int g, int t, float f) {
  const float pf = f / (float)(1 << (B * p)), up = (float)(1 << (B * p));
  float v[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int kk = (i < 2 ? 2 * t + i : 2 * t + 8 + (i - 2));
      const float x = __half2float(__float2half_rn(__bfloat162float(qst[(g + 8 * r) * (kDc + kDr) + ch0 +
                                                                        chan_k<PS>(c, p, kk)]) * pf));
      v[r][i] = x;
      qm[r] += x;
      qs[r] += x * up;
    }
  }
  a[0] = pack_f16(v[0][0], v[0][1]);
  a[1] = pack_f16(v[1][0], v[1][1]);
  a[2] = pack_f16(v[0][2], v[0][3]);
  a[3] = pack_f16(v[1][2], v[1][3]);
}


template <int CB, bool CSYM, bool RSYM>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) decode_kernel(const Params p) {
  using C = Cfg<CB>;
  using M = MetaRows<CSYM, RSYM>;
  constexpr bool csym = CSYM, rsym = RSYM;
  extern __shared__ __align__(128) uint8_t smem[];
  float4* part = reinterpret_cast<float4*>(smem + kStages * C::STAGE);
  // P fragments alias the partial scores: written after the 2nd barrier of a tile, when every warp has read them
  uint4* pfrag = reinterpret_cast<uint4*>(part);
  float* smax = reinterpret_cast<float*>(smem + kStages * C::STAGE + C::PART + C::QFRAG);  // [head][warp]
  float* soff = smax + kHeads * kWarps;  // [group][head][slice]

  pdl_launch_dependents();  // the split merge may launch now (QMLA_PDL; it waits for this grid to finish)
  const int hg = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int h0 = hg * kHeads;
  const int n = p.lens[b];
  const int lo = p.sink;
  const int hi = max(n - p.local, p.sink);
  const int pg0 = lo / kPage + sp * p.pps;
  const int pg1 = min(pg0 + p.pps, (hi + kPage - 1) / kPage);
  constexpr int meta_rows = M::ROWS;
  if (empty_split(pg0, pg1)) return;  // a split without pages (ragged lengths): nothing to write, the merge skips it

  const uint8_t* pool = p.pool;
  const int* bt = p.block_table + (long long)b * p.bt_stride;
  auto issue = [&](int blk, int st) {  // blk: the page's block-table entry
    const uint8_t* page = pool + (long long)blk * p.page_bytes;
    load_page<CB, kThreads>(smem_u32(smem + st * C::STAGE), page, p, meta_rows);
  };
  // the first page is on its way while q is prepared (stage 0; q is staged behind it)
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (pg0 + s < pg1) issue(bt[pg0 + s], s);
    cp_async_commit();
  }
  int blk_next = pg0 + kStages - 1 < pg1 ? bt[pg0 + kStages - 1] : 0;  // read a tile before its use

  // ---- q: bf16(q * qk_scale) of the CTA's 16 heads staged once in shared memory (stage_q, interleaved form), the
  // CTA's largest |q| -> e; then each warp's fp16 A fragments (its content group, then the 4 RoPE k-blocks)
  __nv_bfloat16* qst = reinterpret_cast<__nv_bfloat16*>(smem + C::STAGE);  // [head][576]
  const int e = stage_q<kHeads, kThreads>(qst, smax, p, b, h0);
  const float q_down = exp2i(-e), two_e = exp2i(e);
  uint4* qfrag = reinterpret_cast<uint4*>(smem + kStages * C::STAGE + C::PART);  // [k-block][lane]
  uint4* qfrag_c = qfrag + warp * (C::CPG * C::F) * 32;  // this warp's content k-blocks
  uint4* qfrag_r = qfrag + kWarps * (C::CPG * C::F) * 32;  // the 4 RoPE k-blocks (shared by all warps)
  float qmc[2] = {0.f, 0.f}, qsc[2] = {0.f, 0.f}, qmr[2] = {0.f, 0.f}, qsr[2] = {0.f, 0.f};
  {
    uint32_t a[4];
#pragma unroll 1
    for (int c = 0; c < C::CPG; ++c)
#pragma unroll
      for (int pl = 0; pl < C::F; ++pl) {
        load_qfrag<C::PS, CB>(a, qmc, qsc, qst, kGroup * warp, c, pl, g, t, q_down);
        qfrag_c[(c * C::F + pl) * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
      }
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int pl = 0; pl < 2; ++pl) {
        load_qfrag<32, 4>(a, qmr, qsr, qst, kDc, c, pl, g, t, q_down);
        if (warp == 0) qfrag_r[(c * 2 + pl) * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        qmc[r] += __shfl_xor_sync(0xffffffffu, qmc[r], o);
        qsc[r] += __shfl_xor_sync(0xffffffffu, qsc[r], o);
        qmr[r] += __shfl_xor_sync(0xffffffffu, qmr[r], o);
        qsr[r] += __shfl_xor_sync(0xffffffffu, qsr[r], o);
      }
  }
  // accumulator starts: the magic numbers' 1024 * sum(q as used), and the symmetric formats' 2^(b-1) offset
  float c_init[2], r_init[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    c_init[r] = -fmaf(1024.f, qmc[r], csym ? (float)(1 << (CB - 1)) * qsc[r] : 0.f);
    r_init[r] = -fmaf(1024.f, qmr[r], rsym ? 8.f * qsr[r] : 0.f);
  }

  float o[C::CPG * C::NF][4];
#pragma unroll
  for (int i = 0; i < C::CPG * C::NF; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, corr[2] = {0.f, 0.f};

  for (int it = 0; pg0 + it < pg1; ++it) {
    const int pg = pg0 + it;
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (pg + kStages - 1 < pg1) issue(blk_next, (it + kStages - 1) % kStages);
    cp_async_commit();
    if (pg + kStages < pg1) blk_next = bt[pg + kStages];

    const uint8_t* st = smem + (it % kStages) * C::STAGE;
    const uint32_t st_u = smem_u32(st);
    const __half* meta = reinterpret_cast<const __half*>(st + C::M_SM);
    const int tok_lo = lo - pg * kPage, tok_hi = hi - pg * kPage;  // valid tokens: [tok_lo, tok_hi)
    const bool edge = tok_lo > 0 || tok_hi < kPage;                 // some token of the tile is out of range

    // ---- (1) partial scores of group `warp`, all 64 tokens: acc[n-block][c-frag], in 2^-e units
    float s_acc[8][4];  // started by the first mma (c = 0, plane 0) at c_init
#pragma unroll
    for (int c = 0; c < C::CPG; ++c) {
      const int chunk = warp * C::CPG + c;
      uint32_t R[8];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int tok = 8 * (4 * hf + (lane >> 3)) + (lane & 7);
        ldsm_x4(R[4 * hf], R[4 * hf + 1], R[4 * hf + 2], R[4 * hf + 3],
                st_u + C::C_SM + tok * C::CBYTES + 16 * (chunk ^ (lane & 7)));
      }
      uint32_t qa[C::F][4];
#pragma unroll
      for (int pl = 0; pl < C::F; ++pl) regs4(qa[pl], qfrag_c[(c * C::F + pl) * 32 + lane]);
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        uint32_t f[C::NF];
        score_fields<CB>(R[nb], f);
#pragma unroll
        for (int pl = 0; pl < C::F; ++pl) {
          if (c == 0 && pl == 0)
            mma_f16_c(s_acc[nb], qa[pl], f[pl], f[C::F + pl], c_init[0], c_init[1]);
          else
            mma_f16(s_acc[nb], qa[pl], f[pl], f[C::F + pl]);
        }
      }
    }
    // scale by the group's per-token scale, add the offset term
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      const int tau = 8 * nb + 2 * t;
      const float2 s2 = __half22float2(*reinterpret_cast<const __half2*>(meta + (M::CS + warp) * kPage + tau));
      if (csym) {
#pragma unroll
        for (int e2 = 0; e2 < 4; ++e2) s_acc[nb][e2] *= (e2 & 1) ? s2.y : s2.x;
      } else {
        const float2 o2 = __half22float2(*reinterpret_cast<const __half2*>(meta + (M::CO + warp) * kPage + tau));
#pragma unroll
        for (int e2 = 0; e2 < 4; ++e2)
          s_acc[nb][e2] = fmaf((e2 & 1) ? s2.y : s2.x, s_acc[nb][e2], ((e2 & 1) ? o2.y : o2.x) * qsc[e2 >> 1]);
      }
    }
    // RoPE scores of this warp's 16 tokens (n-blocks 2w, 2w+1)
    float racc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      racc[i][0] = racc[i][1] = r_init[0];
      racc[i][2] = racc[i][3] = r_init[1];
    }
    {
      uint32_t rr[4];  // [chunk][n-block half]: matrices (tokens 16w + 8(mi&1) .., chunk mi>>1)
      const int mi = lane >> 3;
      const int tok = 16 * warp + 8 * (mi & 1) + (lane & 7);
      ldsm_x4(rr[0], rr[1], rr[2], rr[3], st_u + C::R_SM + (mi >> 1) * (kPage * 16) + tok * 16);
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int nbl = 0; nbl < 2; ++nbl) {
          uint32_t f[4];
          score_fields<4>(rr[2 * c + nbl], f);
#pragma unroll
          for (int pl = 0; pl < 2; ++pl) {
            uint32_t qa[4];
            regs4(qa, qfrag_r[(c * 2 + pl) * 32 + lane]);
            mma_f16(racc[nbl], qa, f[pl], f[2 + pl]);
          }
        }
#pragma unroll
      for (int nbl = 0; nbl < 2; ++nbl) {
        const int tau = 16 * warp + 8 * nbl + 2 * t;
        const float2 s2 = __half22float2(*reinterpret_cast<const __half2*>(meta + M::RS * kPage + tau));
        float2 o2 = make_float2(0.f, 0.f);
        if (!rsym) o2 = __half22float2(*reinterpret_cast<const __half2*>(meta + M::RO * kPage + tau));
#pragma unroll
        for (int e2 = 0; e2 < 4; ++e2)
          racc[nbl][e2] = fmaf((e2 & 1) ? s2.y : s2.x, racc[nbl][e2], ((e2 & 1) ? o2.y : o2.x) * qsr[e2 >> 1]);
      }
    }
    // ---- (2) reduce-scatter of the partial scores: warp w gets the full scores of its slice (tokens 16w..16w+15)
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
      part[(warp * 8 + nb) * 32 + lane] = make_float4(s_acc[nb][0], s_acc[nb][1], s_acc[nb][2], s_acc[nb][3]);
    __syncthreads();
    float sc[2][4];  // [n-block of the slice][c-frag]: heads g, g+8 x tokens 16w + 8i + 2t (+1), 2^-e units
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) sc[i][e2] = racc[i][e2];
#pragma unroll
      for (int v = 0; v < kWarps; ++v) {
        const float4 x = part[(v * 8 + 2 * warp + i) * 32 + lane];
        sc[i][0] += x.x;
        sc[i][1] += x.y;
        sc[i][2] += x.z;
        sc[i][3] += x.w;
      }
    }
    bool tok_ok[2][2] = {{true, true}, {true, true}};
    if (edge) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int tau = 16 * warp + 8 * i + 2 * t + e2;
          tok_ok[i][e2] = tau >= tok_lo && tau < tok_hi;
          sc[i][e2] = tok_ok[i][e2] ? sc[i][e2] : -INFINITY;
          sc[i][e2 + 2] = tok_ok[i][e2] ? sc[i][e2 + 2] : -INFINITY;
        }
    }
    float mv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mv[r] = fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1]));
      mv[r] = fmaxf(mv[r], __shfl_xor_sync(0xffffffffu, mv[r], 1));
      mv[r] = fmaxf(mv[r], __shfl_xor_sync(0xffffffffu, mv[r], 2));
    }
    if (t == 0) {
      smax[g * kWarps + warp] = mv[0];
      smax[(g + 8) * kWarps + warp] = mv[1];
    }
    __syncthreads();
    // online softmax in log2 units (q carries qk_scale); every warp derives the same tile maximum, so the same
    // (warp-uniform) decision to move the running maximum
    float mt[2];
    bool need[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float4 m4 = *reinterpret_cast<const float4*>(smax + (g + 8 * r) * kWarps);
      mt[r] = fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w)) * two_e;
      need[r] = mt[r] > m_run[r] + kLazy;  // false for an empty tile (-inf)
    }
    if (__any_sync(0xffffffffu, need[0] || need[1])) {
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = need[r] ? mt[r] : m_run[r];
        alpha[r] = ex2(m_run[r] - m_new);  // 1 when it stays, 0 from -inf
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
        corr[r] *= alpha[r];
      }
#pragma unroll
      for (int i = 0; i < C::CPG * C::NF; ++i)
#pragma unroll
        for (int e2 = 0; e2 < 4; ++e2) o[i][e2] *= alpha[e2 >> 1];
    }
    const float msafe[2] = {m_run[0] == -INFINITY ? 0.f : m_run[0], m_run[1] == -INFINITY ? 0.f : m_run[1]};
    // P of the slice; P * s_g (bf16) as A fragments of k-block w for each group g; sum_t P o_g per group
    float pv[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) {
        pv[i][e2] = ex2(fmaf(sc[i][e2], two_e, -msafe[e2 >> 1]));
        l_run[e2 >> 1] += pv[i][e2];
      }
#pragma unroll
    for (int gr = 0; gr < kWarps; ++gr) {
      float sv[2][2], ov[2][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int tau = 16 * warp + 8 * i + 2 * t;
        const float2 s2 = __half22float2(*reinterpret_cast<const __half2*>(meta + (M::CS + gr) * kPage + tau));
        float2 o2 = make_float2(0.f, 0.f);
        if (!csym) o2 = __half22float2(*reinterpret_cast<const __half2*>(meta + (M::CO + gr) * kPage + tau));
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const float sx = e2 ? s2.y : s2.x;
          sv[i][e2] = sx;
          ov[i][e2] = csym ? -(float)(1 << (CB - 1)) * sx : (e2 ? o2.y : o2.x);
        }
      }
      if (edge) {  // an out-of-range token's meta may be anything (NaN): P = 0 is not enough
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            sv[i][e2] = tok_ok[i][e2] ? sv[i][e2] : 0.f;
            ov[i][e2] = tok_ok[i][e2] ? ov[i][e2] : 0.f;
          }
      }
      pfrag[(gr * kWarps + warp) * 32 + lane] =
          make_uint4(pack_bf16(pv[0][0] * sv[0][0], pv[0][1] * sv[0][1]), pack_bf16(pv[0][2] * sv[0][0], pv[0][3] * sv[0][1]),
                     pack_bf16(pv[1][0] * sv[1][0], pv[1][1] * sv[1][1]), pack_bf16(pv[1][2] * sv[1][0], pv[1][3] * sv[1][1]));
      float po[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        po[r] = pv[0][2 * r] * ov[0][0] + pv[0][2 * r + 1] * ov[0][1] + pv[1][2 * r] * ov[1][0] +
                pv[1][2 * r + 1] * ov[1][1];
        po[r] += __shfl_xor_sync(0xffffffffu, po[r], 1);
        po[r] += __shfl_xor_sync(0xffffffffu, po[r], 2);
      }
      if (t == 0) {
        soff[(gr * kHeads + g) * kWarps + warp] = po[0];
        soff[(gr * kHeads + g + 8) * kWarps + warp] = po[1];
      }
    }
    __syncthreads();
    // ---- (3) output product of group `warp`: O += sum_t bf16(P s) c, 16 independent accumulator chains
    uint32_t ap[4][4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) regs4(ap[kb], pfrag[(warp * kWarps + kb) * 32 + lane]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float4 o4 = *reinterpret_cast<const float4*>(soff + (warp * kHeads + g + 8 * r) * kWarps);
      corr[r] += (o4.x + o4.y) + (o4.z + o4.w);
    }
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {  // two k-blocks (32 tokens) per ldmatrix.x4.trans
#pragma unroll
      for (int c = 0; c < C::CPG; ++c) {
        const int chunk = warp * C::CPG + c;
        uint32_t R[4];
        const int mi = lane >> 3;
        const int tok = 16 * (2 * kp + (mi >> 1)) + 8 * (mi & 1) + (lane & 7);
        ldsm_x4_t(R[0], R[1], R[2], R[3], st_u + C::C_SM + tok * C::CBYTES + 16 * (chunk ^ (lane & 7)));
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < C::NF; ++j)
            mma(o[c * C::NF + j], ap[2 * kp + h], code<CB>(R[2 * h], j), code<CB>(R[2 * h + 1], j));
      }
    }
  }

  // ---- epilogue: normalized partial output and log2-sum-exp of this split
  float inv_l[2], lse[2];
  __syncthreads();  // smax is free again: reuse it for the per-warp sums of P
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) smax[(g + 8 * r) * kWarps + warp] = l;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float4 l4 = *reinterpret_cast<const float4*>(smax + (g + 8 * r) * kWarps);
    const float l = (l4.x + l4.y) + (l4.z + l4.w);
    inv_l[r] = l > 0.f ? 1.f / l : 0.f;
    lse[r] = l > 0.f ? m_run[r] + log2f(l) : -INFINITY;
  }
  const long long row0 = ((long long)b * p.ns_total + sp) * p.H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + g + 8 * r;
    if (h >= p.H) continue;
    float* out = p.po + (row0 + h) * kDc + kGroup * warp;
    if (warp == 0 && t == 0) p.pl[row0 + h] = lse[r];
#pragma unroll
    for (int c = 0; c < C::CPG; ++c)
#pragma unroll
      for (int j = 0; j < C::NF; ++j) {
        const int ch = 16 * c + 4 * t + j / C::F + C::PS * (j % C::F);
        out[ch] = (o[c * C::NF + j][2 * r] + corr[r]) * inv_l[r];
        out[ch + 2] = (o[c * C::NF + j][2 * r + 1] + corr[r]) * inv_l[r];
      }
  }
}

// The kernel family for mla_launch.cuh (3 CTAs per SM need ~225 KB of shared memory: the carveout takes it all).
struct MmaKernel {
  static constexpr int kThreads = qmla::kThreads;
  template <int CB, int RB>
  static constexpr bool has = RB == 4 && (CB == 2 || CB == 4);
  template <int CB, int RB>
  static constexpr bool has_token_scale = false;  // C4R4T / C2R4T: the Hopper kernel only
  static int heads_per_cta(int, int) { return kHeads; }
  static int head_ctas(int H, int) { return (H + kHeads - 1) / kHeads; }
  template <int CB, int RB>
  static int smem(int) { return Cfg<CB>::SMEM; }
  template <int CB, int RB, bool CSYM, bool RSYM>
  static KernelFn fn(int) { return decode_kernel<CB, CSYM, RSYM>; }
};

}  // namespace qmla

// grid (ceil(H / 16), splits, B)
QMLA_EXPORT_DECODE(qmla::MmaKernel)
