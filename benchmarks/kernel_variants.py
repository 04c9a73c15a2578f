"""Compile-time variants of the Hopper decode kernel, side by side: registers and spills offline, speed on the GPU.

``decode_mla_sm90.cu`` reads its tuning knobs from macros, defaults in ``mla_sm90_cfg.cuh``: ``QMLA_SM90_QK_DEPTH`` /
``QMLA_SM90_PV_DEPTH`` (wgmma batches left in flight after each commit of the score / output product),
``QMLA_SM90_MIN_CTAS`` (the launch bounds' CTAs per SM), ``QMLA_SM90_PV_F16`` (the 4/2-bit output product in fp16,
default 1);
``QMLA_COMBINE_WIDE`` (``mla_launch.cuh``: the split merge for many splits in 32-channel blocks), ``QMLA_Q_VEC``
(``mla_query.cuh``: q staged with 16-byte loads), both default 1.
Each variant is a copy of the kernel sources with those macros defined at the top of every ``.cu``, built through
``QUANTMLA_CUDA_SRC`` like any development source folder.

    python benchmarks/kernel_variants.py compile                   # here (nvcc, no GPU): registers, spills, C75xx
    python benchmarks/kernel_variants.py run --out DIR --tag T     # GPU: bench_decode.py per variant (checks first;
                                                                   # --tests: the wgmma GPU tests per variant too)

``run`` writes ``DIR/kernel_variants_<T>.{json,md}`` (us per variant and shape, and the ratio to ``base``, every
variant timed by the same script in its own process, one after the other on one GPU). FlashMLA BF16 is timed in the
first variant's run with ``--flashmla-prebuilt SO`` (an extension built before) or ``--flashmla DIR`` (a checkout from
``benchmarks/prepare_flashmla.sh``, built there in ~2 min; ``--flashmla-build /tmp/fmbuild`` keeps the build where
the extension ``flashmla_dense_bench.so`` can be copied out for later calls).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from results_io import gpu_tag, write_results  # benchmarks/: the one temp-file-and-rename; the GPU model

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "quantmla" / "kernels" / "csrc"
KERNEL = "decode_mla_sm90"

VARIANTS: dict[str, dict[str, int]] = {
    "base": {},  # the defaults in the source: depth 1 / 1, 2 CTAs per SM
    "sync": {"QMLA_SM90_QK_DEPTH": 0, "QMLA_SM90_PV_DEPTH": 0},  # no wgmma overlap at all: what asynchrony buys
    "qk2": {"QMLA_SM90_QK_DEPTH": 2},
    "pv2": {"QMLA_SM90_PV_DEPTH": 2},
    # the three defaults of 2026-12-01 (kernel_variants_h200_s12.md), each switched back off
    "pvbf16": {"QMLA_SM90_PV_F16": 0},  # 4/2-bit output product in bf16 (fp16 with P s 2^k is the default)
    "combine4": {"QMLA_COMBINE_WIDE": 0},  # >= 128 splits merged in 128-channel blocks x 4 split groups
    "qpairs": {"QMLA_Q_VEC": 0},  # q staged with 2-byte loads (72 per thread; 16-byte ones are the default)
    "off3": {"QMLA_SM90_PV_F16": 0, "QMLA_COMBINE_WIDE": 0, "QMLA_Q_VEC": 0},  # the kernel of 811e7c4
    "nopdl": {"QMLA_PDL": 0},  # no programmatic launches, the buffer kernel on a side stream (the default until
    # 2026-12-01: 1.08x at B1 x 128K and B32 x 4K with them, 1.00x at the large shapes; kernel_variants_h200_s14a.md)
    "merge4": {"QMLA_COMBINE_V4": 1, "QMLA_COMBINE_WIDE": 0},  # the 16-byte split merge at every split count
    "merge1": {"QMLA_COMBINE_V4": 0},  # the scalar merge below 128 splits (the default until 2026-12-01)
    "ctas3": {"QMLA_SM90_MIN_CTAS": 3},  # offline: spills (<= 324 B) and ptxas serializes the wgmma (C7512)
    # 3 CTAs (12 warps) per SM with fewer A-fragment registers in flight (2026-12-02, offline, nvcc 13.0: 168
    # registers, C4R4 244 B of spill stores (~46 spill instructions per warp and tile in the main loop), no serialized
    # wgmma; QK depth 0 alone: <= 304 B, none serialized; PV depth 0 alone: C7512). Measured 2026-12-02
    # (kernel_variants_h200_s20_ctas3.md): a third warp per scheduler does not pay -- ctas3qk0 0.84-0.89x base,
    # ctas3runqk0 / ctas3runsync 0.88-0.96x; `run` 1.00-1.05x (C4R4; the other formats not yet timed).
    "ctas3sync": {"QMLA_SM90_MIN_CTAS": 3, "QMLA_SM90_QK_DEPTH": 0, "QMLA_SM90_PV_DEPTH": 0},
    "ctas3qk0": {"QMLA_SM90_MIN_CTAS": 3, "QMLA_SM90_QK_DEPTH": 0},
    # score accumulator sets (QMLA_SM90_SCORE_RUN): the default folds two sets for C4R4 / C2R4 and keeps five for
    # C8R8 / C4R8 (kernel_variants_h200_s21_run.md); "norun": five everywhere, "runall": two everywhere
    "norun": {"QMLA_SM90_SCORE_RUN": 0},
    "runall": {"QMLA_SM90_SCORE_RUN": 2},
    "ctas3run": {"QMLA_SM90_MIN_CTAS": 3, "QMLA_SM90_SCORE_RUN": 2},
    "ctas3runqk0": {"QMLA_SM90_MIN_CTAS": 3, "QMLA_SM90_SCORE_RUN": 2, "QMLA_SM90_QK_DEPTH": 0},
    "ctas3runpv0": {"QMLA_SM90_MIN_CTAS": 3, "QMLA_SM90_SCORE_RUN": 2, "QMLA_SM90_PV_DEPTH": 0},
    "ctas3runsync": {"QMLA_SM90_MIN_CTAS": 3, "QMLA_SM90_SCORE_RUN": 2, "QMLA_SM90_QK_DEPTH": 0,
                     "QMLA_SM90_PV_DEPTH": 0},
    # fewer instructions per tile, written offline in session 21 (C4R4 main loop 1,525 -> 1,420 SASS instructions per
    # warp and tile, C8R8 1,796 -> 1,468), the defaults since session 22 measured them together on the H200: 1.00-1.12x
    # over the former forms at every packed format (kernel_variants_h200_s22_levers.md; each lever apart:
    # kernel_variants_h200_s22_each.md). These variants turn them off again: the stmatrix (P s)^T tiles and the fold's
    # scales kept for the softmax, PRMT for 8-bit codes, the address bases, all five
    "nopstsm_meta": {"QMLA_SM90_P_STSM": 0, "QMLA_SM90_META_ONCE": 0},
    "noprmt8": {"QMLA_PRMT8": 0},
    "noaddr": {"QMLA_SM90_ADDR_BASES": 0, "QMLA_PAGE_BASES": 0},
    "nolevers": {"QMLA_SM90_P_STSM": 0, "QMLA_SM90_META_ONCE": 0, "QMLA_PRMT8": 0, "QMLA_SM90_ADDR_BASES": 0,
                 "QMLA_PAGE_BASES": 0},
    # packed codes as fp16 magic numbers 1024 + 2^k c again, the bias taken off in the accumulators' starts and by one
    # HFMA2 per pair of the output product (the default until session 28; the subnormal codes that replaced it cut the
    # main loop C4R4 1,420 -> 1,283, C4R4T 1,249 -> 1,055, C8R8 1,469 -> 1,338 SASS instructions per warp and tile and
    # ran 1.02-1.07x faster, kernel_variants_h200_s28_subnormal.md; session 22's C8R8-only "pvmagic8", which took the
    # HFMA2 off through P s at a cost in accumulator bits, is gone with it)
    "nosubnormal": {"QMLA_SM90_SUBNORMAL": 0},
    # each product's ldmatrix issued one batch ahead, as until session 28 (two ahead, the default since: C4R4
    # 1.01-1.02x, C4R4T 1.03-1.04x, kernel_variants_h200_s28_ldsm2.md)
    "ldsm1": {"QMLA_SM90_LDSM_AHEAD": 1},
    # (session 26's spike "tokscale", QMLA_SM90_TOKEN_SCALE, is the T formats' instantiation now: --formats c4r4t)
    # the warp-specialized kernel (decode_mla_sm90_ws.cu; time it with --formats c4r4@ws --heads 32,64): its page ring
    "ws4": {"QMLA_WS_STAGES": 4},  # 4 pages (2 copies in flight while two are in use; the default is 6)
    # the ws kernel with subnormal codes (as the wgmma kernel's default since session 28; written offline in session
    # 28: its output warpgroups' 512 HFMA2 go; the symmetric C2R4 instantiations spill 16 B; H200: GPU tests pass,
    # C4R4 at 32 heads 1.01-1.02x, kernel_variants_h200_s28_wssub.md)
    "wssub": {"QMLA_WS_SUBNORMAL": 1},
    # the heads-on-M kernel (decode_mla_sm90_hm.cu; time with --formats c4r4@hm,c2r4@hm --heads 64,128). Session 37
    # made five forms its defaults, measured on the H100: session 36's producer forms -- fields unpacked in place under
    # per-plane magic numbers (QMLA_HM_INPLACE), loads of 16 tokens x 32 bytes per warp instruction (TOKMAP), q staged
    # with 16-byte loads (QVEC): 1.12-1.17x together, kernel_variants_h100_hm_s37.md -- then each tile buffer released
    # after its own output product (EARLY: 1.13-1.20x) and an L2 bulk prefetch two pages ahead (PREFETCH: 1.03-1.05x
    # alone, 1.22-1.28x with EARLY; kernel_variants_h100_hm_s37b.md). These variants turn them off again
    "hm_s36": {"QMLA_HM_INPLACE": 0, "QMLA_HM_TOKMAP": 0, "QMLA_HM_QVEC": 0, "QMLA_HM_EARLY": 0, "QMLA_HM_PREFETCH": 0,
               "QMLA_HM_LDNEXT": 0, "QMLA_HM_QREG": 0, "QMLA_HM_REG_PRODUCER": 72, "QMLA_HM_REG_CONSUMER": 216},
    "hm_s37a": {"QMLA_HM_EARLY": 0, "QMLA_HM_PREFETCH": 0, "QMLA_HM_LDNEXT": 0, "QMLA_HM_QREG": 0,
                "QMLA_HM_REG_PRODUCER": 72, "QMLA_HM_REG_CONSUMER": 216},  # the producer forms only
    "hm_late": {"QMLA_HM_EARLY": 0},  # both buffers released after both output products
    "hm_nopf": {"QMLA_HM_PREFETCH": 0},
    # session 38 (H100, kernel_variants_h100_hm_s38_ld.md / _ldq.md): the producer loads page it + 1 while it unpacks
    # page it (LDNEXT, with 80 producer / 208 consumer registers: no spills) and q kept in registers until its exponent
    # is known, stored without bank conflicts (QREG): 1.01-1.05x together, the defaults since. These turn them off.
    "hm_s37": {"QMLA_HM_LDNEXT": 0, "QMLA_HM_QREG": 0, "QMLA_HM_REG_PRODUCER": 72, "QMLA_HM_REG_CONSUMER": 216},
    "hm_nold": {"QMLA_HM_LDNEXT": 0, "QMLA_HM_REG_PRODUCER": 72, "QMLA_HM_REG_CONSUMER": 216},
    "hm_noqreg": {"QMLA_HM_QREG": 0},
    # written offline at the end of session 38, not yet timed: each consumer issues its next own tile's first score
    # group before it waits for the other's P (ncu: ~43% of a consumer's time at that wait), frame rescale branch-free
    # measured in session 39 (H100, C4R4, 64 heads, B32 x 32K, kernel_variants_h100_hm_s39.md): 0.96x. Kept as a
    # variant for the record; the 128-byte swizzle of q and the tiles (hm_sw) was 1.00x there and is removed
    # (benchmarks/micro/smem_operand_rate.cu: the layout does not change the products' rate)
    "hm_pre": {"QMLA_HM_PRE": 1},
    "hm_pf4": {"QMLA_HM_PREFETCH": 4},
    # (session 40's hm_split / hm_split_pub -- FlashMLA's order, buffers released by halves -- measured 0.90-0.95x in
    # session 42, kernel_variants_h100_hm_s42.md, and removed from the kernel)
    # the split merge in the page kernel (mla_fused_merge.cuh, written offline in session 29, not yet run on a GPU):
    # the last CTA of a (sequence, head group) merges its partials, no merge kernel (up to 16 slots per sequence);
    # the main loops' SASS moves by -19..+20 instructions (more UMOV: uniform registers), sass_loop.py
    "fusedmerge": {"QMLA_FUSED_MERGE": 1},
    # ablations (mla_sm90_ablate.cuh, session 30): where a tile's time goes, one part taken away. Timing only -- the
    # result is wrong on purpose: its rows stay in the table (marked), its GPU tests are not run. Static main loops
    # (sass_loop.py -D QMLA_SM90_ABLATE=..., C4R4 / C4R4T): 1,283 / 1,056 on the defaults
    "abl_score": {"QMLA_SM90_ABLATE": 1},  # no score product, nor its unpacking: 1,008 / 805
    "abl_output": {"QMLA_SM90_ABLATE": 2},  # no output product, nor its unpacking: 1,002 / 806
    "abl_mma": {"QMLA_SM90_ABLATE": 3},  # neither product: 657 / 475 (softmax, meta, copies, barriers)
    "abl_unpack": {"QMLA_SM90_ABLATE": 4},  # both products on the raw ldmatrix words: 943 / 718
    "abl_dram": {"QMLA_SM90_ABLATE": 8},  # every copy from the pool's page 0 (L2-resident): 1,284 / 1,057
    # session 31: the output product costs ~5x the score product (kernel_variants_h200_s31_ablate.md); does it stall
    # the loop at the score product's second wait (groups complete in order)? Three batches of cover (qk2: two),
    # and qk2 with the output product ablated
    "qk3": {"QMLA_SM90_QK_DEPTH": 3},  # offline: no spills; ptxas serializes C2R4's wgmma (C7514): C4R4(T) only
    "qk2_abl_output": {"QMLA_SM90_QK_DEPTH": 2, "QMLA_SM90_ABLATE": 2},
    # session 31: a second page in flight (three staged pages; C4R4 88 KB of shared memory, two CTAs per SM still;
    # C8R8 would drop to one): offline 244-252 registers, no spills, main loops within 3 instructions of base
    "stages3": {"QMLA_SM90_STAGES": 3},
    "stages3_abl_mma": {"QMLA_SM90_STAGES": 3, "QMLA_SM90_ABLATE": 3},  # the floor without products, vs abl_mma
    # session 32 (stages3 alone 0.95-0.99x on the H100): with three stages the next page's copy can be issued after
    # the P barrier and waited for before the next one, so the barrier at the top of the tile goes (two a tile, not
    # three; the same cover). Offline: no spills, 246-254 registers, main loops within 1 instruction of stages3
    "stages3_late": {"QMLA_SM90_STAGES": 3, "QMLA_SM90_LATE_COPY": 1},
    # session 32: the softmax's cross-warp exchange (maximum, largest scale) only when a barrier-vote says something
    # moves, and every 8 tiles. Offline: no spills, 246-248 registers; the whole C4R4 kernel +248 static instructions
    # (both paths, and 18 WARPSYNC before the now-conditional shuffles), the fast path ~45 fewer per warp and tile
    "vote": {"QMLA_SM90_VOTE": 1},
    "stages3_late_vote": {"QMLA_SM90_STAGES": 3, "QMLA_SM90_LATE_COPY": 1, "QMLA_SM90_VOTE": 1},
}


def is_ablation(name: str) -> bool:
    """Whether a variant takes part of the kernel away (timing only: its result is wrong on purpose)."""
    return "=" not in name and bool(VARIANTS.get(name, {}).get("QMLA_SM90_ABLATE", 0))


def kept_rows(name: str, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rows for the table, rows left out): a failed check leaves a row out, except an ablation's, whose result is
    wrong by design (it stays, with its timing); a row without a time is always left out."""
    bad = [r for r in rows if r.get("us") is None or (not r.get("ok") and not is_ablation(name))]
    return [r for r in rows if r not in bad], bad


def make_source(name: str, root: Path) -> Path:
    """A copy of the kernel sources with the variant's macros defined first in every library; returns the folder.
    ``NAME=DIR``: the sources in DIR as they are (e.g. an earlier commit's, ``git archive``), named NAME."""
    if "=" in name:
        src_dir, defs = Path(name.split("=", 1)[1]), ""
        if not (src_dir / f"{KERNEL}.cu").is_file():
            raise SystemExit(f"variant {name!r}: {src_dir} has no {KERNEL}.cu")
    elif name in VARIANTS:
        src_dir, defs = CSRC, "".join(f"#define {k} {v}\n" for k, v in VARIANTS[name].items())
    else:
        raise SystemExit(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)} or NAME=SOURCE_DIR")
    d = root / label(name)
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(src_dir, d)
    for src in sorted(d.glob("*.cu")) if defs else ():  # every library (the mma kernel shares q staging, the merge)
        src.write_text(f"// variant {name} (benchmarks/kernel_variants.py)\n{defs}" + src.read_text())
    return d


def label(name: str) -> str:
    return name.split("=", 1)[0]


def defines(name: str) -> str:
    return f"sources {name.split('=', 1)[1]}" if "=" in name else str(VARIANTS[name] or "defaults")


def compile_report(names: list[str], root: Path) -> None:
    """nvcc -cubin -Xptxas -v of each variant: register range, largest spill, serialized-wgmma warnings."""
    from quantmla.kernels.cuda_build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found: pip install nvidia-cuda-nvcc-cu12 (or set QUANTMLA_NVCC)")
    for name in names:
        d = make_source(name, root)
        cmd = [nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o",
               str(d / "k.cubin"), str(d / f"{KERNEL}.cu"), "-Xptxas", "-v"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        log = r.stdout + r.stderr
        if r.returncode:
            raise SystemExit(f"variant {name} does not compile:\n{log[-3000:]}")
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
        regs = [x for x in regs if x > 64]  # the kernels, not the small helpers in the same file
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
        serial = sorted({c for c in re.findall(r"\((C751[245])\)", log)})
        print(
            f"{name:8s} registers {min(regs)}-{max(regs)}  spill stores <= {max(spills, default=0)} B  "
            f"serialized wgmma: {', '.join(serial) or 'none'}",
            flush=True,
        )


def tested_kernel(formats: str) -> str:
    """The CUDA kernel whose GPU tests a variant run takes (pytest -k): the one the formats name (``c4r4@hm`` ->
    ``hm``, ``@ws`` -> ``ws``), else the wgmma kernel, this script's subject."""
    named = {f.partition("@")[2] for f in formats.split(",") if "@" in f} - {"", "wgmma", "mma"}
    if len(named) > 1:
        raise SystemExit(f"--tests: one kernel's variants at a time, the formats name {sorted(named)}")
    return named.pop() if named else "wgmma"


def flashmla_args(src: str | None, build: str | None, prebuilt: str | None) -> list[str]:
    """bench_decode.py's FlashMLA arguments for the first variant's run: a checkout built there (``--flashmla DIR``,
    its build in ``build``, default DIR's own folder), or an extension built before (``--flashmla-prebuilt``), or
    none; both at once, or a build folder without a checkout, is a clear error."""
    if src and prebuilt:
        raise SystemExit("--flashmla and --flashmla-prebuilt: give one (a checkout to build, or its build)")
    if build and not src:
        raise SystemExit("--flashmla-build names where --flashmla DIR is built: give --flashmla too")
    if src:
        return ["--flashmla", src, *(["--flashmla-build", build] if build else [])]
    return ["--flashmla-prebuilt", prebuilt] if prebuilt else []


def run(names: list[str], root: Path, out: Path, tag: str, formats: str, shapes: str, heads: str,
        tests: bool = False, fm_args: list[str] | tuple = ()) -> None:  # fmt: skip
    """bench_decode.py once per variant (same shapes, its own process); the table of all of them. ``fm_args``
    (:func:`flashmla_args`) go to the first variant's run: FlashMLA is timed there."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    descr: dict[str, str] = {}
    for name in names:
        d = make_source(name, root)
        env = dict(os.environ, QUANTMLA_CUDA_SRC=str(d), QUANTMLA_CACHE=str(d / "cache"))
        env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
        vtag = f"variant_{tag}_{label(name)}"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--out", str(root), "--tag", vtag,
               "--formats", formats, "--shapes", shapes, "--heads", heads]  # fmt: skip
        if fm_args and name == names[0]:  # FlashMLA's rows once, in the first variant's run
            cmd += list(fm_args)
        print(f"== {label(name)}: {defines(name)}", flush=True)
        descr[label(name)] = defines(name)
        if is_ablation(name):
            descr[label(name)] += "; ablation: timing only, the result is wrong on purpose"
        elif tests:  # the timed kernel's GPU tests against this variant's build, before timing it
            t = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rf", "--tb=line", "-p",
                                "no:cacheprovider", str(ROOT / "tests" / "kernels" / "test_decode_cuda.py"), "-k",
                                tested_kernel(formats)], env=env, check=False)  # fmt: skip
            descr[label(name)] += f"; GPU tests {'passed' if t.returncode == 0 else 'FAILED'}"
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode and fm_args and name == names[0]:  # e.g. the extension does not build or load: without it
            print(f"{label(name)}: bench_decode failed with FlashMLA (rc {proc.returncode}); again without", flush=True)
            proc = subprocess.run(cmd[: len(cmd) - len(fm_args)], env=env, check=False)
        path = root / f"decode_vs_flashmla_{vtag}.json"
        if proc.returncode or not path.exists():
            print(f"{name}: bench_decode failed (rc {proc.returncode})", flush=True)
            continue
        rows, bad = kept_rows(name, json.loads(path.read_text())["rows"])
        for r in bad:
            print(f"{name}: {r['impl']} B{r['batch']} x {r['context']} FAILED its check (not in the table)", flush=True)
        results[label(name)] = rows
    write_table(results, descr, out, tag, formats, shapes, heads)


def write_table(results: dict[str, list[dict]], descr: dict[str, str], out: Path, tag: str, formats: str, shapes: str,
                heads: str) -> None:  # fmt: skip
    key = lambda r: (r["heads"], r["batch"], r["context"], r["impl"])  # noqa: E731
    fm = {k[:3]: r["us"] for rs in results.values() for r in rs if (k := key(r))[3] == "flashmla-bf16"}
    results = {n: [r for r in rs if r["impl"] != "flashmla-bf16"] for n, rs in results.items()}
    base = {key(r): r["us"] for r in results.get("base", [])}
    cols = list(dict.fromkeys(key(r) for rows in results.values() for r in rows))
    commit = os.environ.get("QUANTMLA_COMMIT", "unknown")
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"), "commit": commit,
            "command": " ".join(sys.argv), "formats": formats, "shapes": shapes, "heads": heads,
            "variants": descr}  # fmt: skip
    try:
        import torch

        meta["device"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 -- the table is still worth writing
        meta["device"] = "unknown"
    rows = [{"variant": n, "heads": k[0], "batch": k[1], "context": k[2], "impl": k[3], "us": us,
             "vs_base": (base[k] / us) if k in base else None, "vs_flashmla": (fm[k[:3]] / us) if k[:3] in fm else None}
            for n, rs in results.items() for k, us in ((key(r), r["us"]) for r in rs)]  # fmt: skip
    rows += [{"variant": "flashmla-bf16", "heads": h, "batch": b, "context": n, "impl": "flashmla-bf16", "us": us}
             for (h, b, n), us in fm.items()]  # fmt: skip
    lines = [f"# Hopper kernel variants, {meta['device']}, {meta['date']}, commit {commit}", "",
             f"`{meta['command']}`; each variant's bench_decode.py run checks it first, then times CUDA-graph "
             "replays after an L2 flush (median of 20). Cells: us (speed-up over base).", "",
             "| variant | defines | " + " | ".join(f"H{h} B{b} x {n} {i}" for h, b, n, i in cols) + " |",
             "|---|---|" + "---|" * len(cols)]  # fmt: skip
    for n, rs in results.items():
        us = {key(r): r["us"] for r in rs}
        cells = [f"{us[c]:.1f} ({base[c] / us[c]:.2f}x)" if c in us and c in base else
                 (f"{us[c]:.1f}" if c in us else "-") for c in cols]  # fmt: skip
        lines.append(f"| {n} | {descr[n]} | " + " | ".join(cells) + " |")
    if fm:  # FlashMLA BF16 was timed (in the first variant's process): every variant's speed-up over it
        lines += ["", "Speed-up over FlashMLA BF16 (timed in the first variant's run: "
                  + ", ".join(f"H{h} B{b} x {n} {us:.1f} us" for (h, b, n), us in fm.items()) + "):", "",
                  "| variant | " + " | ".join(f"H{h} B{b} x {n} {i}" for h, b, n, i in cols) + " |",
                  "|---|" + "---|" * len(cols)]  # fmt: skip
        for n, rs in results.items():
            us = {key(r): r["us"] for r in rs}
            cells = [f"{fm[c[:3]] / us[c]:.2f}x" if c in us and c[:3] in fm else "-" for c in cols]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    write_results(
        str(out / f"kernel_variants_{tag}"),
        {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"},
    )
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["compile", "run"])
    ap.add_argument("--variants", default="base,sync,qk2,pv2", help="comma-separated of: " + ", ".join(VARIANTS))
    ap.add_argument("--work", default="/tmp/quantmla_variants", help="folder for the variant sources and builds")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="default: the GPU model that runs (h100, h200)")
    ap.add_argument("--formats", default="c4r4@wgmma")
    ap.add_argument("--shapes", default="32x32768,8x131072,1x131072,32x4096")
    ap.add_argument("--heads", default="16")
    ap.add_argument("--tests", action="store_true",
                    help="run: the GPU tests of the timed kernel (wgmma, or the one --formats names) per variant first")
    ap.add_argument("--flashmla-prebuilt", default=None,
                    help="run: FlashMLA's extension (bench_decode.py --flashmla-prebuilt), timed in the first "
                         "variant's run: the table gains a FlashMLA column and ratios to it")  # fmt: skip
    ap.add_argument("--flashmla", default=None, metavar="DIR",
                    help="run: a FlashMLA checkout (benchmarks/prepare_flashmla.sh), built in the first variant's run "
                         "instead of --flashmla-prebuilt; its extension lands in --flashmla-build (carry that as "
                         ".fmbuild for later calls)")
    ap.add_argument("--flashmla-build", default=None, metavar="DIR", help="run: where --flashmla is built")
    a = ap.parse_args()
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    if a.what == "compile":
        compile_report(names, root)
    else:
        fm = flashmla_args(a.flashmla, a.flashmla_build, a.flashmla_prebuilt)
        run(names, root, Path(a.out), a.tag or gpu_tag(), a.formats, a.shapes, a.heads, a.tests, fm)


if __name__ == "__main__":
    main()
