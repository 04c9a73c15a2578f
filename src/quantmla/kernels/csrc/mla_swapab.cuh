// Pieces of the swap-AB decode kernels (decode_mla_sm90.cu, mla_sm90_bf16.cuh): the S^T fragment's head columns, the
// per-head exchanges of the softmax across the warpgroup, and (packed pages) q^T staged once per CTA as the B
// operand of the score product with the per-(group, head) accumulator starts and q sums.
//
// Score k-block kb (16 channels): kb < 32 is content group kb / 8, chunk (kb % 8) / F, plane (kb % 8) % F; kb >= 32
// is RoPE chunk (kb - 32) / RF, plane (kb - 32) % RF; k-index kk of it is channel chan_k(chunk, plane, kk) (the
// channel order of the A fragments the kernel unpacks). Values: fp16(bf16(q qk_scale) 2^-e 2^-(b p)), exact (a
// power-of-two scaling of a bf16 value inside fp16's range), in the K-major core-matrix layout of mla_wgmma.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mla_ops.cuh"
#include "mla_page.cuh"
#include "mla_query.cuh"
#include "mla_sm90_cfg.cuh"
#include "mla_wgmma.cuh"

namespace qmla {

// A thread's NC = N / 4 head columns c of an m64nN accumulator (N = 16: 4, N = 32: 8): head 8 (c / 2) + 2t + c % 2;
// element of d for (row half ri = token 16w + g + 8 ri, column c)
__device__ __forceinline__ int head_of(int c, int t) { return 8 * (c >> 1) + 2 * t + (c & 1); }
__host__ __device__ constexpr int acc_idx(int ri, int c) { return 4 * (c >> 1) + (c & 1) + 2 * ri; }

// Per head: the maximum of v[2][NC] over the thread's two rows and the warp's 8 row pairs, into red[head][warp]
// (a barrier must follow before the reads).
template <int NC>
__device__ __forceinline__ void heads_max_to(float* red, const float (&v)[2][NC], int warp, int g, int t) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float m = fmaxf(v[0][c], v[1][c]);
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (g == 0) red[head_of(c, t) * 4 + warp] = m;
  }
}

// Per head: the sum of x[NC] over the warp's 8 row pairs, into red[head][warp] (a barrier must follow).
template <int NC>
__device__ __forceinline__ void heads_sum_to(float* red, const float (&x)[NC], int warp, int g, int t) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float s = x[c];
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (g == 0) red[head_of(c, t) * 4 + warp] = s;
  }
}

__device__ __forceinline__ float4 head_row(const float* red, int c, int t) {  // red[head_of(c, t)][0..3]
  return *reinterpret_cast<const float4*>(red + head_of(c, t) * 4);
}

// The sum of red[head_of(c, t)][0..3] (a quantity summed per warp by heads_sum_to).
__device__ __forceinline__ float head_total(const float* red, int c, int t) {
  const float4 v = head_row(red, c, t);
  return (v.x + v.y) + (v.z + v.w);
}

// x[0..NC) = row[0..NC) from shared memory, 16 bytes at a time (row 16-byte aligned)
template <int NC>
__device__ __forceinline__ void load_row(float (&x)[NC], const float* row) {
#pragma unroll
  for (int i = 0; i < NC; i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(row + i);
    x[i] = v.x;
    x[i + 1] = v.y;
    x[i + 2] = v.z;
    x[i + 3] = v.w;
  }
}

// Slot of head h in a [.. ][4 t][NC] table of per-(thread, column) values: t(h) = (h % 8) / 2, c(h) = 2 (h / 8) + h % 2
template <int NC>
__device__ __forceinline__ int head_slot(int h) { return ((h & 7) >> 1) * NC + 2 * (h >> 3) + (h & 1); }

// Score-product A fragments of one B-bit chunk (hx) of an ldmatrix.x4 (R: token g / g+8 of chunk x, then of chunk
// x + 1): a[p] = rows g / g+8, plane p of chunk x + hx, as fp16 magic numbers (SUB: subnormals; mla_ops.cuh
// score_fields).
template <int B, bool SUB = false>
__device__ __forceinline__ void score_frag(const uint32_t (&R)[4], int hx, uint32_t (&a)[8 / B][4]) {
  constexpr int F = 8 / B;
  uint32_t f0[16 / B], f1[16 / B];
  score_fields<B, SUB>(R[2 * hx], f0);
  score_fields<B, SUB>(R[2 * hx + 1], f1);
#pragma unroll
  for (int pl = 0; pl < F; ++pl) {
    a[pl][0] = f0[pl];
    a[pl][1] = f1[pl];
    a[pl][2] = f0[F + pl];
    a[pl][3] = f1[F + pl];
  }
}

// Both chunks: a[hx][p] as score_frag.
template <int B, bool SUB = false>
__device__ __forceinline__ void score_frags(const uint32_t (&R)[4], uint32_t (&a)[2][8 / B][4]) {
  score_frag<B, SUB>(R, 0, a[0]);
  score_frag<B, SUB>(R, 1, a[1]);
}

// qt: 36 k-blocks of HEADS * 32 bytes; qst: bf16 q [HEADS][ROW] (mla_query.cuh stage_q; ROW = 584 puts the rows
// of 8 heads on distinct banks); qb: [2][5][4 t][HEADS / 4] floats (accumulator starts -(1024 sum q + the symmetric
// offset), then q sums in 2^-e units), slot of head h = group * HEADS + head_slot(h). Ends with a CTA barrier.
// SUB (subnormal codes, no magic bias): the starts are the symmetric offsets alone, and starts and q sums carry the
// products' 2^-24.
template <int CB, int RB, bool CSYM, bool RSYM, int HEADS, int THREADS, int ROW = kDc + kDr, bool SUB = false>
__device__ __forceinline__ void stage_qt(uint8_t* qt, const __nv_bfloat16* qst, float q_down, float* qb) {
  using C = PageCfg<CB, RB>;
  constexpr int F = C::F, PS = C::PS, RF = C::RF, RPS = C::RPS, kKBlock = HEADS * 32;
  static_assert(HEADS == 16 || HEADS == 32, "16 or 32 heads (N of the products)");
  static_assert(ROW % 8 == 0, "16-byte aligned q rows");
  const int tid = threadIdx.x;
  // k-block kb of head h: its 16 channels (chan_k: 16 c + PS p + 4 i + 2 j + kh for k = 8 kh + 2 i + j) are
  // contiguous in q, two 16-byte reads; the k-half kh is every other one (word 2 i + j, low half for kh = 0): both
  // 16-byte rows of the operand from one read (the 2-byte gathers before: 16 per read, 16-way bank conflicts at
  // ROW = 576, and a division per row -- ncu 2026-12-01: ~28% of a one-page CTA's stall samples)
  for (int r = tid; r < 36 * HEADS; r += THREADS) {
    const int kb = r / HEADS, h = r % HEADS;
    int ch, bits, pl;
    if (kb < 32) {
      pl = (kb & 7) % F;
      ch = kGroup * (kb >> 3) + 16 * ((kb & 7) / F) + PS * pl;
      bits = CB;
    } else {
      pl = (kb - 32) % RF;
      ch = kDc + 16 * ((kb - 32) / RF) + RPS * pl;
      bits = RB;
    }
    const float pf = q_down * exp2i(-bits * pl);  // 2^(-e - b p): the product is exact, as the division was
    const uint4* src = reinterpret_cast<const uint4*>(qst + h * ROW + ch);
    const uint4 v0 = src[0], v1 = src[1];
    const uint32_t x[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};  // channel pairs (2m, 2m + 1)
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo[i] = pack_f16(__uint_as_float(x[2 * i] << 16) * pf, __uint_as_float(x[2 * i + 1] << 16) * pf);
      hi[i] = pack_f16(__uint_as_float(x[2 * i] & 0xFFFF0000u) * pf,
                       __uint_as_float(x[2 * i + 1] & 0xFFFF0000u) * pf);
    }
    uint8_t* dst = qt + kb * kKBlock;
    *reinterpret_cast<uint4*>(dst + kblock_offset(0, h)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    *reinterpret_cast<uint4*>(dst + kblock_offset(8, h)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  }
  fence_proxy_async();
  __syncthreads();
  for (int r = tid; r < 5 * HEADS; r += THREADS) {  // from the fp16 values as used
    const int gr = r / HEADS, h = r % HEADS;
    const int nkb = gr < 4 ? 8 : 4, kb0 = gr < 4 ? 8 * gr : 32, bits = gr < 4 ? CB : RB, planes = gr < 4 ? F : RF;
    float qm = 0.f, qs = 0.f;
    for (int i = 0; i < nkb; ++i) {
      const float up = (float)(1 << (bits * (i % planes)));
      for (int kk = 0; kk < 16; ++kk) {
        const float x = __half2float(*reinterpret_cast<const __half*>(qt + (kb0 + i) * kKBlock + kblock_offset(kk, h)));
        qm += x;
        qs += x * up;
      }
    }
    const bool sym = gr < 4 ? CSYM : RSYM;
    const float init = -fmaf(SUB ? 0.f : 1024.f, qm, sym ? (float)(1 << (bits - 1)) * qs : 0.f);
    const float sub = SUB ? 0x1p-24f : 1.f;
    const int slot = gr * HEADS + head_slot<HEADS / 4>(h);  // [group][t][c]
    qb[slot] = init * sub;
    qb[5 * HEADS + slot] = qs * sub;
  }
  __syncthreads();
}

// The CTA's normalized partial output, po[(row0 + h) * 512 + channel] for this thread's output rows (channels: see
// the kernel's header) and heads: (O^T o_down[hh] + corr) / l (o_down per accumulator half hh). Rows ri = 0, 1 are
// channels ch, ch + 1, stored as one 8-byte pair (1.00-1.02x over 4-byte stores, kernel_variants_h200_s14b.md; the
// epilogue was ~16% of a one-page CTA's stall samples, ncu 2026-12-01).
template <bool kC8, int CPG, int PS, int NG, int NC, int NH>
__device__ __forceinline__ void store_partial(float* po, long long row0, int H, int h0,
                                              const float (&oacc)[2 * NG][NH / 2], const float (&o_down)[2],
                                              const float (&corr)[NG][NC], const float (&inv_l)[NC], int warp, int g,
                                              int t) {
  auto value = [&](int gi, int hh, int ri, int c) {
    return fmaf(oacc[2 * gi + hh][acc_idx(ri, c)], o_down[hh], corr[gi][c]) * inv_l[c];
  };
#pragma unroll
  for (int gi = 0; gi < NG; ++gi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int ch = kC8 ? kGroup * gi + 16 * (warp + 4 * hh) + 2 * g  // row ri = 0's channel (even); ri = 1: + 1
                         : kGroup * gi + 16 * (warp % CPG) + 2 * g + PS * (2 * (warp / CPG) + hh);
#pragma unroll
      for (int c = 0; c < NC; ++c) {  // one 8-byte store per pair, whole sectors per warp
        const int h = h0 + head_of(c, t);
        if (h < H)
          *reinterpret_cast<float2*>(po + (row0 + h) * kDc + ch) =
              make_float2(value(gi, hh, 0, c), value(gi, hh, 1, c));
      }
    }
}

// fp16 output product: P s is carried as P s 2^k, k (CTA-uniform) from the largest content scale seen so that the
// largest P s 2^k is in [2^14, 2^15). Per tile, each warp puts the largest |scale| of its valid tokens (an
// out-of-range token's meta may be anything: skipped) over NPT scale vectors into smx[warp] (a barrier must follow);
// then p_exponent moves k lazily (when the tile's scales would overflow, or have shrunk 2^8-fold) and returns the
// exact power of two 2^(new k - old k) that rescales the fp32 accumulators (1 when k stays).
template <int NPT>
__device__ __forceinline__ void warp_max_scale_to(float* smx, const float (&sv)[4][2], const bool (&tok_ok)[2],
                                                  int warp, int lane) {
  float sm = 0.f;
#pragma unroll
  for (int gr = 0; gr < NPT; ++gr)
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) sm = tok_ok[ri] ? fmaxf(sm, fabsf(sv[gr][ri])) : sm;
#pragma unroll
  for (int o = 4; o <= 16; o <<= 1) sm = fmaxf(sm, __shfl_xor_sync(0xffffffffu, sm, o));
  if (lane == 0) smx[warp] = sm;
}
__device__ __forceinline__ float p_exponent(const float* smx, int& k_run, bool& k_set) {
  float k_scale = 1.f;
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
  return k_scale;
}

// QMLA_SM90_VOTE: whether this thread's tile would move the running maximum (a score above m_run + kLazy, the test
// the exchange makes on the tile maximum: the maximum of the products is the product of the maximum, so the same
// decision) or raise k (a scale whose k_want is below k_run: p_exponent's test on the CTA's largest scale holds iff
// it holds for some thread's). A shrinking k -- p_exponent's other move, precision only -- waits for an exchange
// (the kernel makes one every 8 tiles).
template <int NPT, bool F16OUT, int NC>
__device__ __forceinline__ int vote_moves(const float (&sc)[2][NC], const float (&sv)[4][2], const bool (&tok_ok)[2],
                                          const float (&m_run)[NC], float two_e, int k_run) {
  bool moves = false;
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) moves |= sc[ri][c] * two_e > m_run[c] + kLazy;  // -inf (invalid): false
  if constexpr (F16OUT) {
    float sm = 0.f;
#pragma unroll
    for (int gr = 0; gr < NPT; ++gr)
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) sm = tok_ok[ri] ? fmaxf(sm, fabsf(sv[gr][ri])) : sm;
    if (sm > 0.f && sm <= 65504.f) moves |= 6 - (((__float_as_int(sm) >> 23) & 0xff) - 127) < k_run;
  }
  return moves;
}

// The meta of token tau of a staged page (fp16 rows, mla_page.cuh MetaRows M) into slot ri: content scales and
// offsets per group, RoPE scale and offset (0 for a symmetric path).
template <bool CSYM, bool RSYM, typename M>
__device__ __forceinline__ void load_meta(const __half* meta, int tau, int ri, float (&sv)[4][2], float (&ov)[4][2],
                                          float (&rsv)[2], float (&rov)[2]) {
  rsv[ri] = __half2float(meta[M::RS * kPage + tau]);
  rov[ri] = RSYM ? 0.f : __half2float(meta[M::RO * kPage + tau]);
#pragma unroll
  for (int gr = 0; gr < 4; ++gr) {
    sv[gr][ri] = __half2float(meta[(M::CS + gr) * kPage + tau]);
    ov[gr][ri] = CSYM ? 0.f : __half2float(meta[(M::CO + gr) * kPage + tau]);
  }
}

}  // namespace qmla
