// The query side of the Hopper decode kernel prepared once per (sequence, 16-head group) instead of once per CTA
// (QMLA_SM90_QPREP; decode_mla_sm90.cu). Every split CTA of a sequence stages the same q: bf16 rounding, its
// exponent e, the q^T operand of the score product and the accumulator starts / q sums (mla_query.cuh stage_q,
// mla_swapab.cuh stage_qt) -- ~40% of a one-page CTA's stall samples (ncu 2026-12-01, before the q^T staging was
// made cheaper). With QMLA_SM90_QPREP a small kernel (grid (head groups, 1, B)) runs exactly that code once and
// writes the result to a workspace (Params::q_ws, kQPrepBytes per sequence and head group); the page kernel reads it
// with 16-byte loads into the same shared-memory regions. The bytes are the same, so the results are bit for bit
// those of the default path. With QMLA_PDL as well the page kernel is a programmatic dependent launch of the prep
// kernel (mla_launch.cuh ProgrammaticLaunch): its CTAs start, read the block table and issue their first pages while
// the prep kernel runs, and wait for it only before reading the workspace (the prep kernel itself is an ordinary
// launch: everything before it is complete when it starts, so the pages the page kernel reads first are too).
//
// Workspace block: [0, 18432) the q^T k-blocks (fp16, the QT region), [18432, 19072) the accumulator starts and q
// sums (the QB region, [2][5][4 t][4] floats), [19072, 19076) e (int); blocks kQPrepBytes apart.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_query.cuh"
#include "mla_sm90_cfg.cuh"
#include "mla_swapab.cuh"

#ifndef QMLA_SM90_QPREP  // 1: q prepared once per sequence and head group (written 2026-12-01, unmeasured)
#define QMLA_SM90_QPREP 0
#endif

namespace qmla {
namespace sm90 {

constexpr int kQtBytes = kQkBlocks * 16 * 32;        // 36 k-blocks of 16 heads x 16 fp16
constexpr int kQbBytes = 2 * 5 * 16 * 4;             // accumulator starts and q sums
constexpr int kQPrepBytes = kQtBytes + kQbBytes + 128;  // + e, rounded to 128 bytes
constexpr int kPrepQst = 0, kPrepQt = 16 * kQRow * 2, kPrepQb = kPrepQt + kQtBytes, kPrepRed = kPrepQb + kQbBytes;
constexpr int kPrepSmem = kPrepRed + 16 * 4 * 4;
static_assert(kPrepQt % 128 == 0 && kPrepQb % 16 == 0 && kQtBytes / 16 == 9 * kThreads, "prep layout");

#if QMLA_SM90_QPREP
template <int CB, int RB, bool CSYM, bool RSYM>
__global__ void __launch_bounds__(kThreads) qprep_kernel_sm90(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_launch_dependents();  // QMLA_PDL: the page kernel may start now (it waits for this grid before reading q_ws)
  const int hg = blockIdx.x, b = blockIdx.z, tid = threadIdx.x;
  __nv_bfloat16* qst = reinterpret_cast<__nv_bfloat16*>(smem + kPrepQst);
  float* qb = reinterpret_cast<float*>(smem + kPrepQb);
  const int e = stage_q<16, kThreads, true, kQRow>(qst, reinterpret_cast<float*>(smem + kPrepRed), p, b, hg * 16);
  stage_qt<CB, RB, CSYM, RSYM, 16, kThreads, kQRow>(smem + kPrepQt, qst, exp2i(-e), qb);
  uint8_t* dst = p.q_ws + ((long long)b * gridDim.x + hg) * kQPrepBytes;
  const uint4* src = reinterpret_cast<const uint4*>(smem + kPrepQt);  // QT then QB: contiguous here
  for (int i = tid; i < (kQtBytes + kQbBytes) / 16; i += kThreads) reinterpret_cast<uint4*>(dst)[i] = src[i];
  if (tid == 0) *reinterpret_cast<int*>(dst + kQtBytes + kQbBytes) = e;
#endif
}

// The page kernel's prologue with QMLA_SM90_QPREP: the prepared block of (b, hg) into its QT and QB regions; returns
// e. All loads first, then the stores (the compiler cannot tell generic shared stores from global loads); ends with
// the async-proxy fence and a CTA barrier, as stage_qt does.
__device__ __forceinline__ int load_prepared_q(uint8_t* qt, float* qb, const Params& p, int b, int hg) {
  const int tid = threadIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(p.q_ws + ((long long)b * gridDim.x + hg) * kQPrepBytes);
  pdl_wait();  // launched programmatically after the prep kernel (QMLA_PDL): its workspace is complete from here
  uint4 r[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) r[k] = __ldg(src + tid + kThreads * k);
  const bool has_b = tid < kQbBytes / 16;
  const uint4 rb = has_b ? __ldg(src + kQtBytes / 16 + tid) : make_uint4(0u, 0u, 0u, 0u);
  const int e = __ldg(reinterpret_cast<const int*>(src + (kQtBytes + kQbBytes) / 16));
#pragma unroll
  for (int k = 0; k < 9; ++k) reinterpret_cast<uint4*>(qt)[tid + kThreads * k] = r[k];
  if (has_b) reinterpret_cast<uint4*>(qb)[tid] = rb;
  fence_proxy_async();
  __syncthreads();
  return e;
}

template <int CB, int RB>
int launch_qprep_bits(const Params& p, dim3 grid, cudaStream_t stream) {
  const bool cs = p.c_orow < 0, rs = p.r_orow < 0;
  auto go = [&](void (*k)(Params)) {
    k<<<grid, kThreads, kPrepSmem, stream>>>(p);
    return (int)cudaGetLastError();
  };
  if (cs && rs) return go(qprep_kernel_sm90<CB, RB, true, true>);
  if (cs) return go(qprep_kernel_sm90<CB, RB, true, false>);
  if (rs) return go(qprep_kernel_sm90<CB, RB, false, true>);
  return go(qprep_kernel_sm90<CB, RB, false, false>);
}
#endif

}  // namespace sm90
}  // namespace qmla

// C entry points (the sm90 library only; cuda_decode.py looks them up):
//   qmla_qprep_bytes()   workspace bytes per (sequence, head group) the page kernel expects in Params::q_ws; 0: the
//                        library prepares q in every CTA (QMLA_SM90_QPREP 0)
//   qmla_qprep(p, cbits, rbits, grid_x, grid_z, stream)   the prep kernel for grid (head groups, 1, B)
extern "C" {
int qmla_qprep_bytes() { return QMLA_SM90_QPREP ? qmla::sm90::kQPrepBytes : 0; }
int qmla_qprep(const qmla::Params* p, int cbits, int rbits, int grid_x, int grid_z, void* stream) {
#if QMLA_SM90_QPREP
  const dim3 grid(grid_x, 1, grid_z);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (rbits == 4 && cbits == 4) return qmla::sm90::launch_qprep_bits<4, 4>(*p, grid, st);
  if (rbits == 4 && cbits == 2) return qmla::sm90::launch_qprep_bits<2, 4>(*p, grid, st);
  if (rbits == 8 && cbits == 8) return qmla::sm90::launch_qprep_bits<8, 8>(*p, grid, st);
  if (rbits == 8 && cbits == 4) return qmla::sm90::launch_qprep_bits<4, 8>(*p, grid, st);
#else
  (void)p, (void)cbits, (void)rbits, (void)grid_x, (void)grid_z, (void)stream;
#endif
  return (int)cudaErrorInvalidValue;
}
}
