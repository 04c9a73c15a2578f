#!/usr/bin/env bash
# Make .flashmla/: the FlashMLA source tree that `bench_decode.py --flashmla .flashmla` builds at run time on the GPU
# machine (which has no network), from two git mirrors: FlashMLA, and CUTLASS at the commit FlashMLA's
# csrc/cutlass submodule pins. Only what the dense SM90 decode build reads: FlashMLA's csrc/ without sm100/, and
# CUTLASS's include/ and tools/util/include/. The folder is git-ignored (never committed, never vendored): carry it
# to the device with `carry: [".flashmla"]` (and `.fmbuild`, a previous build, to skip the ~60-90 s compile).
#
#   bash benchmarks/prepare_flashmla.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR [OUT]      (OUT defaults to .flashmla)
#
# e.g. with the mirrors of the `fetch` tool: /work/.mirror/deepseek-ai+FlashMLA/repo /work/.mirror/NVIDIA+cutlass/repo
set -euo pipefail
FM=${1:?usage: prepare_flashmla.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR [OUT]}
CU=${2:?usage: prepare_flashmla.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR [OUT]}
OUT=${3:-.flashmla}
sub=$(git --git-dir="$FM" ls-tree HEAD csrc/cutlass | awk '{print $3}')
[ -n "$sub" ] || { echo "no csrc/cutlass submodule in $FM" >&2; exit 1; }
git --git-dir="$CU" cat-file -e "$sub^{commit}" 2>/dev/null || { echo "CUTLASS commit $sub is not in $CU" >&2; exit 1; }
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp/csrc/cutlass"
git --git-dir="$FM" archive HEAD csrc | tar -x -C "$OUT.tmp" --exclude=csrc/sm100 --exclude=csrc/cutlass
# (a partial mirror lacks blobs outside these folders; git names one of them, harmless: filtered)
git --git-dir="$CU" archive "$sub" include tools/util/include 2> >(grep -v "invalid object" >&2) |
  tar -x -C "$OUT.tmp/csrc/cutlass"
echo "FlashMLA $(git --git-dir="$FM" rev-parse HEAD), CUTLASS $sub" > "$OUT.tmp/SOURCE"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT: $(du -sh "$OUT" | cut -f1) ($(cat "$OUT/SOURCE"))"
