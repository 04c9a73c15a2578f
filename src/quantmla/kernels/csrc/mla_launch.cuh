// Host side shared by the decode kernels' libraries (decode_mla.cu, decode_mla_sm90.cu): one-time configuration of
// each instantiation, the launch (after checking that the page layout the host describes is the one compiled in),
// the occupancy query, and the C entry points every library exports (QMLA_EXPORT_DECODE).
//
// A kernel family K provides: K::kThreads; template <int CB, int RB> static constexpr bool has (it is built for CB-bit
// content and RB-bit RoPE codes); static int heads_per_cta(int H, int CB) (N of the products for H query heads) and
// static int head_ctas(int H, int CB) (CTAs per split and sequence: the grid's x); template <int CB, int RB> static
// int smem(int nh) (dynamic shared memory bytes); and template <int CB, int RB, bool CSYM, bool RSYM> static KernelFn
// fn(int nh) (the __global__ function), for nh = heads_per_cta. One content scale per token (Params::c_groups == 1,
// the T formats): template <int CB, int RB> static constexpr bool has_token_scale, and where it is true template <int
// CB, int RB> static KernelFn fn_ts(int nh) (asymmetric content and RoPE).
#pragma once

#include <cuda_runtime.h>

#include "mla_combine.cuh"

#ifndef QMLA_COMBINE_WIDE  // 1: the wide merge for >= 128 splits (mla_combine.cuh); default since 2026-12-01
#define QMLA_COMBINE_WIDE 1  // (H200, B1 x 128K: 5% faster end to end: kernel_variants_h200_s12.md)
#endif
#ifndef QMLA_COMBINE_V4  // 1: the split merge with 16-byte accesses (combine4_kernel) below 128 splits (with
#define QMLA_COMBINE_V4 1  // QMLA_COMBINE_WIDE; every count without); default since 2026-12-01 (H200, C4R4: B32 x 4K
#endif                     // 1.05x, B32 x 32K / B8 x 128K 1.01x, B1 x 128K 0.99x -- there the wide one stays:
                           // kernel_variants_h200_s13m4.md)
#include "mla_page.cuh"

namespace qmla {

using KernelFn = void (*)(Params);

// Whether kernel family K's packed-page kernels are launched as programmatic dependent launches (they then wait,
// griddepcontrol.wait, for the kernel just before them themselves: only the Hopper kernel with QMLA_PDL,
// decode_mla_sm90.cu). BF16 pages never are.
template <typename K>
struct ProgrammaticLaunch {
  static constexpr bool value = false;
};

// Launch kf<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch: it may start before the
// kernel before it in the stream ends (and must wait for it, griddepcontrol.wait, before reading what it wrote).
template <typename KF, typename... Args>
int launch_programmatic(KF kf, dim3 grid, dim3 block, int smem, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, kf, args...);
}

// The one-time state below (function-local statics) lives in an unnamed namespace: each library gets its own copy.
// With external linkage g++ makes such a static a GNU-unique symbol, which the dynamic linker binds process-wide even
// across ctypes' RTLD_LOCAL loads: two libraries built from one kernel family (same symbol names) then shared one
// "configured" flag, and the second one loaded launched unconfigured (> 48 KB shared memory: invalid argument).
namespace {

// The __global__ function of an instantiation (TS: one content scale per token).
template <typename K, int CB, int RB, bool CSYM, bool RSYM, bool TS>
KernelFn kernel_fn(int nh) {
  if constexpr (TS) return K::template fn_ts<CB, RB>(nh);
  else return K::template fn<CB, RB, CSYM, RSYM>(nh);
}

// Once per instantiation: its dynamic shared memory and all of the unified L1/shared memory as shared memory.
template <typename K, int CB, int RB, bool CSYM, bool RSYM, bool TS = false>
cudaError_t configure(int nh) {
  static cudaError_t status[2] = {cudaErrorNotReady, cudaErrorNotReady};  // [nh > 16]
  cudaError_t& st = status[nh > 16];
  if (st == cudaErrorNotReady) {
    const KernelFn k = kernel_fn<K, CB, RB, CSYM, RSYM, TS>(nh);
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, K::template smem<CB, RB>(nh));
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    st = e;
  }
  return st;
}

}  // namespace

template <typename K, int CB, int RB, bool CSYM, bool RSYM, bool TS = false>
int launch(const Params& p, dim3 grid, cudaStream_t stream) {
  using M = MetaRows<CSYM, RSYM, TS ? 1 : 4>;  // the page layout the host describes must be the one compiled in
  if (CB != 16 && (p.c_groups != (TS ? 1 : 4) || p.c_srow != M::CS || p.r_srow != M::RS ||  // (BF16: no meta)
                   p.c_orow != (CSYM ? -1 : M::CO) || p.r_orow != (RSYM ? -1 : M::RO)))
    return (int)cudaErrorInvalidValue;
  if ((int)grid.x != K::head_ctas(p.H, CB)) return (int)cudaErrorInvalidConfiguration;  // the host's grid is stale
  const int nh = K::heads_per_cta(p.H, CB);
  const cudaError_t e = configure<K, CB, RB, CSYM, RSYM, TS>(nh);
  if (e != cudaSuccess) return (int)e;
  const KernelFn kf = kernel_fn<K, CB, RB, CSYM, RSYM, TS>(nh);
  if constexpr (ProgrammaticLaunch<K>::value && CB != 16)
    return launch_programmatic(kf, grid, dim3(K::kThreads), K::template smem<CB, RB>(nh), stream, p);
  kf<<<grid, K::kThreads, K::template smem<CB, RB>(nh), stream>>>(p);
  return (int)cudaGetLastError();
}

template <typename K, int CB, int RB>
int launch_sym(const Params& p, dim3 grid, cudaStream_t stream) {  // symmetric specs have no offset rows
  if constexpr (!K::template has<CB, RB>) {
    return (int)cudaErrorInvalidValue;
  } else {
    const bool cs = p.c_orow < 0, rs = p.r_orow < 0;
    if (CB != 16 && p.c_groups == 1) {  // one content scale per token: asymmetric content and RoPE only
      if constexpr (K::template has_token_scale<CB, RB>) {
        if (!cs && !rs) return launch<K, CB, RB, false, false, true>(p, grid, stream);
      }
      return (int)cudaErrorInvalidValue;
    }
    if (cs && rs) return launch<K, CB, RB, true, true>(p, grid, stream);
    if (cs) return launch<K, CB, RB, true, false>(p, grid, stream);
    if (rs) return launch<K, CB, RB, false, true>(p, grid, stream);
    return launch<K, CB, RB, false, false>(p, grid, stream);
  }
}

template <typename K>
int launch_bits(const Params& p, int cbits, int rbits, dim3 grid, cudaStream_t stream) {
  if (rbits == 4 && cbits == 4) return launch_sym<K, 4, 4>(p, grid, stream);
  if (rbits == 4 && cbits == 2) return launch_sym<K, 2, 4>(p, grid, stream);
  if (rbits == 8 && cbits == 8) return launch_sym<K, 8, 8>(p, grid, stream);
  if (rbits == 8 && cbits == 4) return launch_sym<K, 4, 8>(p, grid, stream);
  if (rbits == 16 && cbits == 16) return launch_sym<K, 16, 16>(p, grid, stream);  // BF16 pages
  return (int)cudaErrorInvalidValue;
}

template <typename K, int CB, int RB>
int ctas_per_sm(int H) {  // every instantiation of (CB, RB, N) has the same registers bound and shared memory
  if constexpr (!K::template has<CB, RB>) {
    return -1;
  } else {
    int n = -1;
    const int nh = K::heads_per_cta(H, CB);
    cudaError_t e = configure<K, CB, RB, false, false>(nh);
    if (e == cudaSuccess)
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, K::template fn<CB, RB, false, false>(nh), K::kThreads,
                                                        K::template smem<CB, RB>(nh));
    return e == cudaSuccess ? n : -1;
  }
}

template <typename K>
int ctas_per_sm_bits(int cbits, int rbits, int H) {
  if (rbits == 4 && cbits == 4) return ctas_per_sm<K, 4, 4>(H);
  if (rbits == 4 && cbits == 2) return ctas_per_sm<K, 2, 4>(H);
  if (rbits == 8 && cbits == 8) return ctas_per_sm<K, 8, 8>(H);
  if (rbits == 8 && cbits == 4) return ctas_per_sm<K, 4, 8>(H);
  if (rbits == 16 && cbits == 16) return ctas_per_sm<K, 16, 16>(H);
  return -1;
}

// One launch of the split merge kernel KF (threads per CTA: NT); with QMLA_PDL on an sm_90+ device a programmatic
// dependent launch (its CTAs may start while the page kernel finishes; the merge waits for it before reading).
namespace {  // (its static: one per library, as configure's above)
template <typename KF>
int launch_merge(KF kf, dim3 grid, int nt, const float* po, const float* pl, float* out, float* lse, int ns, int H,
                 const SplitMap& m, cudaStream_t stream) {
#if QMLA_PDL
  static int major = -1;  // of the device current at the first call (a library is built for one architecture)
  if (major < 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev))
      major = 0;
  }
  if (major >= 9) return launch_programmatic(kf, grid, dim3(nt), 0, stream, po, pl, out, lse, ns, H, m);
#endif
  kf<<<grid, nt, 0, stream>>>(po, pl, out, lse, ns, H, m);
  return (int)cudaGetLastError();
}
}  // namespace

template <int G, int CW>
int launch_combine_grid(dim3 grid, const float* po, const float* pl, float* out, float* lse, int ns, int H,
                        const SplitMap& m, cudaStream_t stream) {
  return launch_merge(combine_kernel<G, kDc, CW>, grid, CW * G, po, pl, out, lse, ns, H, m, stream);
}

template <int W>
int launch_combine4(const float* po, const float* pl, float* out, float* lse, int B, int ns, int H,
                    const SplitMap& m, cudaStream_t stream) {
  return launch_merge(combine4_kernel<W, kDc>, dim3(kDc / 128, H, B), 32 * W, po, pl, out, lse, ns, H, m, stream);
}

// Merge po [B, ns, H, 512] / pl [B, ns, H] (log2 units) into out [B, H, 512] and lse [B, H] (natural log), reading
// of each sequence the slots m names (mla_combine.cuh SplitMap).
inline int launch_combine(const float* po, const float* pl, float* out, float* lse, int B, int ns, int H,
                          const SplitMap& m, cudaStream_t stream) {
  const dim3 grid(kDc / 128, H, B);
#if QMLA_COMBINE_V4  // W warps per 128-channel chunk: the fewest (a power of two, <= 32) with <= 8 splits each
  if (ns <= 8) return launch_combine4<1>(po, pl, out, lse, B, ns, H, m, stream);
  if (ns <= 16) return launch_combine4<2>(po, pl, out, lse, B, ns, H, m, stream);
  if (ns <= 32) return launch_combine4<4>(po, pl, out, lse, B, ns, H, m, stream);
  if (ns <= 64) return launch_combine4<8>(po, pl, out, lse, B, ns, H, m, stream);
  if (ns < 128 || !QMLA_COMBINE_WIDE) {
    if (ns <= 128) return launch_combine4<16>(po, pl, out, lse, B, ns, H, m, stream);
    return launch_combine4<32>(po, pl, out, lse, B, ns, H, m, stream);
  }
#endif
#if QMLA_COMBINE_WIDE
  if (ns >= 128)  // 32-channel blocks, 32 split groups (mla_combine.cuh)
    return launch_combine_grid<32, 32>(dim3(kDc / 32, H, B), po, pl, out, lse, ns, H, m, stream);
#endif
  if (ns >= 64) return launch_combine_grid<4, 128>(grid, po, pl, out, lse, ns, H, m, stream);
  return launch_combine_grid<1, 128>(grid, po, pl, out, lse, ns, H, m, stream);
}

}  // namespace qmla

// The C entry points of a kernel library (loaded with ctypes by quantmla/kernels/cuda_decode.py):
//   qmla_params_size()            sizeof(Params), so the host side can check its ctypes mirror
//   qmla_head_ctas(H, cbits)      CTAs per split and sequence for H query heads: the grid's x
//   qmla_ctas_per_sm(cbits, rbits, H)   CTAs of the kernel that fit on one SM (occupancy calculator), -1 on error
//                                    or for a format the library is not built for
//   qmla_decode(p, cbits, rbits, grid, stream)   launch the packed-page kernel; a cudaError_t code (0 = success;
//                                    cudaErrorInvalidConfiguration when grid x is not qmla_head_ctas(p.H, cbits))
//   qmla_combine(po, pl, out, lse, B, ns, H, lens, sink, local, pps, ns_pages, stream)   merge the splits: of each
//                                    sequence the page splits that had pages (lens: Params::lens, or null for every
//                                    split) and the buffer slots [ns_pages, ns)
//   qmla_error_string(code)
#define QMLA_EXPORT_DECODE(K)                                                                                      \
  extern "C" {                                                                                                     \
  int qmla_params_size() { return (int)sizeof(qmla::Params); }                                                     \
  int qmla_head_ctas(int H, int cbits) { return K::head_ctas(H, cbits); }                                          \
  int qmla_ctas_per_sm(int cbits, int rbits, int H) { return qmla::ctas_per_sm_bits<K>(cbits, rbits, H); }         \
  int qmla_decode(const qmla::Params* p, int cbits, int rbits, int grid_x, int grid_y, int grid_z, void* stream) { \
    return qmla::launch_bits<K>(*p, cbits, rbits, dim3(grid_x, grid_y, grid_z),                                   \
                                reinterpret_cast<cudaStream_t>(stream));                                           \
  }                                                                                                                \
  int qmla_combine(const float* po, const float* pl, float* out, float* lse, int B, int ns, int H, const int* lens, \
                   int sink, int local, int pps, int ns_pages, void* stream) {                                     \
    const qmla::SplitMap m{lens, sink, local, pps, ns_pages};                                                      \
    return qmla::launch_combine(po, pl, out, lse, B, ns, H, m, reinterpret_cast<cudaStream_t>(stream));            \
  }                                                                                                                \
  const char* qmla_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }                        \
  }
