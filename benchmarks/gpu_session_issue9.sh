#!/usr/bin/env bash
# Issue 9 on the H200 in one device call: GPU tests of the CUDA decode kernel, then the side-by-side benchmark
# against FlashMLA (built from a checkout at run time), a per-kernel time table, and (optionally) the same
# benchmark for a baseline kernel source, all in one call.
#
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_session_issue9.sh RESULTS_DIR [STEPS]
#
# FLASHMLA_DIR (default .flashmla): a FlashMLA checkout (csrc/ with the CUTLASS headers it needs; make it with
# benchmarks/prepare_flashmla.sh from git mirrors, 29 MB, and carry it: the tree + .flashmla is ~57 MiB of the 64);
# FLASHMLA_BUILD (default /tmp/fmbuild): its build folder -- carry a previous call's build (fmbuild.tgz from
# RESULTS_DIR, unpacked to .fmbuild) to skip the ~90 s build; BASE_SRC: a folder with another decode_mla.cu to
# time beside the current one (step `base`). STEPS (comma-separated, default micro,tests,bench,profile,base):
#   micro    benchmarks/micro/wgmma_layout_check.cu: the wgmma conventions of the sm_90a kernel        ~20 s
#   tests    pytest -m gpu tests/kernels/test_decode_cuda.py tests/kernels/test_decode.py: the mma kernel,
#            then the wgmma kernel's cases in a process of their own (tests.log, tests_wgmma.log)      ~2 min
#   bench    bench_decode.py: every format, 16 heads, the six issue shapes (tag h200_<TAG>; FORMATS), then
#            C4R4/C2R4 on both CUDA kernels beside FlashMLA (tag h200_<TAG>_wgmma; WGMMA_FORMATS)   ~3 min
#   heads    bench_decode.py --heads 32,64,128 (C4R4/C2R4/BF16, two shapes)                       ~1.5 min
#   profile  torch.profiler per-kernel table for C4R4 at B32x32K, B32x4K, B1x128K                  ~30 s
#   base     bench_decode.py for C4R4 with QUANTMLA_CUDA_SRC=$BASE_SRC (tag h200_<TAG>_base)         ~1 min
#   mutation benchmarks/mutation_check.py --kernel wgmma (MUTATE_KERNEL=mma for the other)           ~3 min
# TAG defaults to s9. Everything lands in RESULTS_DIR (logs, decode_vs_flashmla_*.{json,md,png}, fmbuild.tgz).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
RES=${1:?usage: bash benchmarks/gpu_session_issue9.sh RESULTS_DIR [STEPS]}
STEPS=${2:-micro,tests,bench,profile,base}
FORMATS=${FORMATS:-bf16,c8r8,c4r8,c4r4,c2r4}
WGMMA_FORMATS=${WGMMA_FORMATS:-bf16,c4r4,c2r4,bf16@wgmma,c4r4@wgmma,c2r4@wgmma,c8r8@wgmma,c4r8@wgmma}  # a separate process: a new kernel may hang or fault
TAG=${TAG:-s9}
FM=${FLASHMLA_DIR:-.flashmla}
FMB=${FLASHMLA_BUILD:-/tmp/fmbuild}
mkdir -p "$RES" "$FMB"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QUANTMLA_CACHE=${QUANTMLA_CACHE:-/root/qcache}
if [[ -d .fmbuild && -z "$(ls -A "$FMB")" ]]; then cp -a .fmbuild/. "$FMB"/ && touch "$FMB"/*.so 2>/dev/null; fi
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee "$RES/device.txt"
step() { [[ ",$STEPS," == *",$1,"* ]]; }
# The wgmma kernel has not run anywhere yet: everything that launches it runs in its own process under `timeout`, so
# a hang or a fault there cannot take the mma results (or the rest of the call) with it.
if step micro; then
  nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/quantmla/kernels/csrc -o /tmp/wgmma_check \
    benchmarks/micro/wgmma_layout_check.cu 2>&1 | tail -5 && timeout 60 /tmp/wgmma_check 2>&1 | tee "$RES/micro.log"
fi
if step tests; then
  timeout 240 python -m pytest -m gpu tests/kernels/test_decode_cuda.py tests/kernels/test_decode.py -k "not wgmma" \
    -q -rf --tb=line 2>&1 | tail -15 | tee "$RES/tests.log"
  timeout 240 python -m pytest -m gpu tests/kernels/test_decode_cuda.py -k wgmma -q -rf --tb=line 2>&1 |
    tail -40 | tee "$RES/tests_wgmma.log"
fi
if step bench; then
  timeout 300 python benchmarks/bench_decode.py --flashmla "$FM" --flashmla-build "$FMB" --out "$RES" \
    --tag "h200_$TAG" --formats "$FORMATS" 2>&1 | tee "$RES/bench.log" | tail -30
  tar czf "$RES/fmbuild.tgz" -C "$FMB" . 2>/dev/null
  timeout 200 python benchmarks/bench_decode.py --flashmla "$FM" --flashmla-build "$FMB" --out "$RES" \
    --tag "h200_${TAG}_wgmma" --formats "$WGMMA_FORMATS" 2>&1 | tee "$RES/bench_wgmma.log" | tail -30
fi
if step heads; then
  python benchmarks/bench_decode.py --flashmla "$FM" --flashmla-build "$FMB" --out "$RES" --tag "h200_${TAG}_heads" \
    --heads 32,64,128 --formats bf16,c4r4,c2r4,c4r4@wgmma --shapes 32x32768,8x131072 2>&1 | tee "$RES/heads.log" | tail -20
fi
if step profile; then
  for s in "32 32768" "32 4096" "1 131072" "8 131072"; do
    python benchmarks/profile_decode.py c4r4 $s --table --reps 5 2>&1 | head -14
  done | tee "$RES/profile.log"
fi
if step base && [[ -n ${BASE_SRC:-} ]]; then
  QUANTMLA_CUDA_SRC=$BASE_SRC python benchmarks/bench_decode.py --flashmla "$FM" --flashmla-build "$FMB" --out "$RES" \
    --tag "h200_${TAG}_base" --formats c4r4 2>&1 | tee "$RES/base.log" | tail -12
fi
if step mutation; then
  python benchmarks/mutation_check.py --kernel "${MUTATE_KERNEL:-wgmma}" 2>&1 | tee "$RES/mutation.log" | tail -20
fi
