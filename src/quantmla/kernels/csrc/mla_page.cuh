// The page side of the packed MLA decode kernels (decode_mla.cu, decode_mla_sm90.cu): launch parameters, the
// byte layout of one page of the paged cache (quantmla/kernels/layout.py) as compile-time constants, the copy of a
// page into shared memory, and the channel order of the score product's k-blocks.
//
// Staged page in shared memory (one stage): content rows of CBYTES bytes, chunk x of token n at 16 * (x ^ (n & 7))
// (bank-conflict-free ldmatrix), then the RoPE chunks chunk-major ([chunk][token] x 16 bytes), then the meta rows.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_ops.cuh"

namespace qmla {

constexpr int kPage = 64;    // tokens per page = per tile
constexpr int kDc = 512;     // content latent width
constexpr int kDr = 64;      // RoPE key width
constexpr int kGroup = 128;  // content quantization group
constexpr float kLazy = 8.f;   // log2 units: P <= 2^8 between moves of the running maximum

struct Params {
  const void* q_lat;  // [B, H, 512] bf16 or fp32, last dim contiguous
  const void* q_pe;   // [B, H, 64]
  long long q_lat_sb, q_lat_sh, q_pe_sb, q_pe_sh;  // element strides
  const uint8_t* pool;  // [num_pages, page_bytes]
  long long page_bytes;
  int c_off, r_off, m_off;       // byte offsets of the regions inside a page
  int c_srow, c_orow, r_srow, r_orow;  // meta rows (orow < 0: symmetric spec)
  const int* block_table;  // [B, max_pages]
  long long bt_stride;
  const int* lens;  // [B]
  float* po;        // [B, NS_TOTAL, H, 512] normalized partial outputs
  float* pl;        // [B, NS_TOTAL, H] log2-sum-exp of each partial
  int H, ns_total, pps, sink, local;
  float qk_scale;  // softmax_scale * log2(e)
  int q_fp32;      // 1: q tensors are fp32, 0: bf16
  int pdl_late;    // QMLA_PDL, Hopper kernel: 1 when the kernel before it is the BF16 buffer kernel, which writes
                   // nothing it reads: wait for it at the end only (else at the start, before any read)
  int c_groups;    // content scale groups per token: 4 (groups of 128), 1 (one per token: C4R4T, C2R4T), 0 (BF16)
  // The split merge inside the page kernel (mla_fused_merge.cuh, built with QMLA_FUSED_MERGE): arrivals [B, head
  // CTAs] of zeros, out [B, H, 512], lse [B, H] (natural log). arrivals == null: the merge kernel runs instead.
  int* arrivals;
  float* out;
  float* lse;
};

// The packed pages of a sequence of n tokens (sink and local tokens live in the BF16 buffers): pages [sink / 64,
// ceil(hi / 64)), hi = max(n - local, sink); split sp of a CTA grid covers pps of them from sink / 64 + sp pps. A
// split without pages (a ragged batch's shorter sequences, or lengths below a captured step's planned capacity)
// exits at once and writes nothing; the merge reads only the used_splits that had pages (mla_combine.cuh). The
// host mirror is quantmla.kernels.split_plan.packed_pages / used_splits: kernels, merge and host must agree.
__host__ __device__ __forceinline__ int packed_pages(int n, int sink, int local) {
  const int hi = n - local > sink ? n - local : sink;
  return (hi + kPage - 1) / kPage - sink / kPage;
}
__host__ __device__ __forceinline__ int used_splits(int n, int sink, int local, int pps, int ns) {
  const int used = (packed_pages(n, sink, local) + pps - 1) / pps;
  return used < ns ? used : ns;
}

// Whether this CTA's split has no pages, as a warp-uniform value (a plain branch on it let ptxas take the Hopper
// kernel's wgmma descriptors out of uniform registers: +49 UMOV per tile in its main loop).
__device__ __forceinline__ bool empty_split(int pg0, int pg1) { return __shfl_sync(0xffffffffu, pg0 >= pg1, 0); }
// What a CTA of a split without pages does before it returns: with a programmatic launch after the buffer kernel
// (Params::pdl_late) it waits for that kernel as every other CTA does at its end, so the grid never completes
// before it (the merge's wait covers both only then).
__device__ __forceinline__ void empty_split_exit(const Params& p) {
  if (p.pdl_late) pdl_wait();
}
// Both: whether the CTA leaves at once (it has then done what it must before it returns).
__device__ __forceinline__ bool empty_split_leaves(const Params& p, int pg0, int pg1) {
  if (!empty_split(pg0, pg1)) return false;
  empty_split_exit(p);
  return true;
}

template <int CB, int RB = 4>  // bits of a content code (2, 4 or 8) and of a RoPE code (4 or 8)
struct PageCfg {
  static constexpr int F = 8 / CB;                 // codes per byte (planes)
  static constexpr int NF = 16 / CB;               // codes per 16-bit element (fields)
  static constexpr int CBYTES = kDc * CB / 8;      // content bytes per token
  static constexpr int CPG = kGroup * CB / 8 / 16; // 16-byte chunks per group
  static constexpr int PS = kGroup / F;            // plane stride of the grouped planar packing
  static constexpr int RF = 8 / RB;                // RoPE codes per byte (planes of the plain planar packing)
  static constexpr int RPS = kDr / RF;             // RoPE plane stride
  static constexpr int RBYTES = kDr * RB / 8;      // RoPE bytes per token
  static constexpr int RCH = RBYTES / 16;          // RoPE chunks per token
  static constexpr int C_SM = 0;
  static constexpr int R_SM = kPage * CBYTES;
  static constexpr int M_SM = R_SM + kPage * RBYTES;
  static constexpr int META_ROWS = 10;             // upper bound (4 + 4 content, 1 + 1 RoPE)
  static constexpr int STAGE = M_SM + META_ROWS * kPage * 2;
};

// channel (within its group) of k-index kk of k-block (chunk c, plane p) of the score product
template <int PS>
__device__ __forceinline__ int chan_k(int c, int p, int kk) {
  return 16 * c + PS * p + 4 * ((kk & 7) >> 1) + 2 * (kk & 1) + (kk >> 3);
}

// Meta rows of a page (quantmla.kernels.layout): content scales (one row per group: NCG groups, 4 of 128 channels or
// 1 per token), content offsets (asymmetric content), RoPE scale, RoPE offset (asymmetric RoPE); compile-time, so
// every meta address is an immediate.
template <bool CSYM, bool RSYM, int NCG = 4>
struct MetaRows {
  static_assert(NCG == 4 || NCG == 1, "content scale groups: 4 (128 channels each) or 1 (the whole token)");
  static constexpr int CS = 0, CO = NCG, RS = CSYM ? NCG : 2 * NCG, RO = RS + 1, ROWS = RS + (RSYM ? 1 : 2);
};

// Copy one page into a shared-memory stage with cp.async (16 bytes per thread and round; the caller commits).
#ifndef QMLA_PAGE_BASES  // 1: rows of a page copied in rounds of fewer than 8 tokens (C8R8) from one destination base
#define QMLA_PAGE_BASES 1  // per swizzle phase instead of the swizzle recomputed every round (the same addresses;
#endif                     // default since session 22, H200: kernel_variants_h200_s22_each.md)

template <int CB, int kThreads, int RB = 4>
__device__ __forceinline__ void load_page(uint32_t stage, const uint8_t* page, const Params& p, int meta_rows) {
  using C = PageCfg<CB, RB>;
  const int tid = threadIdx.x;
  constexpr int CX = C::CBYTES / 16;      // chunks per token row
  constexpr int STEP = kThreads / CX;     // tokens per round of the block
  static_assert(kThreads % CX == 0 && kPage % STEP == 0, "copy split");
  const int n0 = tid / CX, x = tid % CX;
  const uint8_t* src = page + p.c_off + n0 * C::CBYTES + 16 * x;
  if constexpr (STEP % 8 == 0) {  // (n0 + i * STEP) & 7 == n0 & 7: the swizzle is the same every round
    const uint32_t dst = stage + C::C_SM + n0 * C::CBYTES + 16 * (x ^ (n0 & 7));
#pragma unroll
    for (int i = 0; i < kPage / STEP; ++i) cp_async16(dst + i * STEP * C::CBYTES, src + i * STEP * C::CBYTES);
  } else if constexpr (QMLA_PAGE_BASES && 8 % STEP == 0) {
    // the swizzle repeats every PER = 8 / STEP rounds: PER destination bases, then constant offsets (C8R8: STEP 4,
    // two bases; the loop below recomputed the swizzle in each of its 16 rounds)
    constexpr int PER = 8 / STEP;
    uint32_t base[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int nn = n0 + k * STEP;
      base[k] = stage + C::C_SM + nn * C::CBYTES + 16 * (x ^ (nn & 7));
    }
#pragma unroll
    for (int i = 0; i < kPage / STEP; ++i)
      cp_async16(base[i % PER] + (i / PER) * 8 * C::CBYTES, src + i * STEP * C::CBYTES);
  } else {
#pragma unroll
    for (int i = 0; i < kPage / STEP; ++i) {
      const int nn = n0 + i * STEP;
      cp_async16(stage + C::C_SM + nn * C::CBYTES + 16 * (x ^ (nn & 7)), src + i * STEP * C::CBYTES);
    }
  }
  constexpr int NR = kPage * C::RCH;  // RoPE chunks, stored chunk-major
  if constexpr (NR <= kThreads) {
    if (tid < NR) {
      const int n = tid / C::RCH, xr = tid % C::RCH;
      cp_async16(stage + C::R_SM + xr * (kPage * 16) + n * 16, page + p.r_off + n * C::RBYTES + 16 * xr);
    }
  } else {
    static_assert(NR % kThreads == 0, "copy split");
#pragma unroll
    for (int r = tid; r < NR; r += kThreads) {
      const int n = r / C::RCH, xr = r % C::RCH;
      cp_async16(stage + C::R_SM + xr * (kPage * 16) + n * 16, page + p.r_off + n * C::RBYTES + 16 * xr);
    }
  }
  if (tid < meta_rows * kPage * 2 / 16) cp_async16(stage + C::M_SM + 16 * tid, page + p.m_off + 16 * tid);
}

}  // namespace qmla
