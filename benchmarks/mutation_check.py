"""Show that the CUDA decode kernels' GPU tests can fail: build deliberately broken copies of a kernel and run
``tests/kernels/test_decode_cuda.py`` (that kernel's cases) against each; every mutation must make the tests fail.

Mutations (each a one-line change of the kernel's source or a header it includes): a 1% softmax-scale error, the
sink boundary one token off, the local-window boundary one token off, the offset term of the output dropped, the
score product's magic-number term off by 1/1024, the output product's code bias off by one. The wgmma kernel, whose
codes are fp16 subnormals (no magic term, no bias), instead: the symmetric accumulator start one code off, the output
codes' lowest bit dropped, the second plane's factor not undone, its BF16 pages' masking of rows outside the tile (NaN
in unwritten slots must not reach the output) and, for its C4R4T / C2R4T instantiation (one content scale per token,
one content score accumulator), the score's offset term dropped and the RoPE scores put into the content
accumulator; for ws the scale, the boundaries, the offset term, the magic term, the code bias, each in the file the
kernel reads it from.
Prints one line per mutation and exits non-zero if any mutation survives. GPU only (``--kernel wgmma|ws|hm``: sm_90);
``--dry-run`` (no GPU) only resolves every pattern to its one file::

    PYTHONPATH=src python benchmarks/mutation_check.py [--kernel mma|wgmma|ws|hm] [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "quantmla" / "kernels" / "csrc"
SOURCES = {
    "mma": "decode_mla.cu",
    "wgmma": "decode_mla_sm90.cu",
    "ws": "decode_mla_sm90_ws.cu",
    "hm": "decode_mla_sm90_hm.cu",
}
# the test ids carry the kernel: test_x[mma-...] / [wgmma-...] / [ws-...]
SELECT = {"mma": "not wgmma and not ws and not hm", "wgmma": "wgmma", "ws": "ws", "hm": "hm"}
# one kernel family's own code, not a shared header (the ws headers read the wgmma kernel's softmax line too)
OTHER_HEADERS = {
    "mla_sm90_bf16.cuh",
    "mla_ws_cfg.cuh",
    "mla_ws_score.cuh",
    "mla_ws_output.cuh",
    "mla_hm.cuh",
}
BIAS = ('"r"(0xC300C300u)', '"r"(0xC2FEC2FEu)')  # mla_ops.cuh, both kernels
MUTATIONS = {
    "mma": {
        "none (control: must pass)": ("", ""),
        "softmax scale +1%": ("ex2(fmaf(sc[i][e2], two_e, -msafe", "ex2(fmaf(sc[i][e2], two_e * 1.01f, -msafe"),
        "sink boundary +1 token": ("const int lo = p.sink;", "const int lo = p.sink + 1;"),
        "local boundary -1 token": ("max(n - p.local, p.sink);", "max(n - p.local + 1, p.sink);"),
        "offset term dropped": ("corr[r] += (o4.x + o4.y) + (o4.z + o4.w);", "corr[r] += 0.f * o4.x;"),
        "score magic term 1024 -> 1023": ("-fmaf(1024.f, qmc[r]", "-fmaf(1023.f, qmc[r]"),
        "output code bias 128 -> 127": BIAS,
    },
    "wgmma": {
        "none (control: must pass)": ("", ""),
        "softmax scale +1%": (
            "ex2(fmaf(sc[ri][c], two_e, -ms))",
            "ex2(fmaf(sc[ri][c], two_e * 1.01f, -ms))",
            "decode_mla_sm90.cu",
        ),  # the ws score roles read the same line
        "sink boundary +1 token": ("const int lo = p.sink;", "const int lo = p.sink + 1;"),
        "local boundary -1 token": ("max(n - p.local, p.sink);", "max(n - p.local + 1, p.sink);"),
        "offset term dropped": (
            "for (int gi = 0; gi < NG; ++gi) corr[gi][c] = head_total(",
            "for (int gi = 0; gi < NG; ++gi) corr[gi][c] = 0.f * head_total(",
        ),
        # (since session 28 the codes are fp16 subnormals, QMLA_SM90_SUBNORMAL: no magic term; the accumulator start
        # is the symmetric offset alone -- C8R8, C4R8's RoPE -- here one code unit off, as the magic term's 1024 ->
        # 1023 was one unit of the q sum)
        "score symmetric start one code off": (
            "sym ? (float)(1 << (bits - 1)) * qs : 0.f);",
            "sym ? (float)((1 << (bits - 1)) - 1) * qs : 0.f);",
            "mla_swapab.cuh",
        ),
        "output codes' lowest bit dropped (subnormal mask)": (
            "if constexpr (SUB) return r & ((((1u << B) - 1u) << (B * p)) * 0x00010001u);",
            "if constexpr (SUB) return r & ((((1u << B) - 2u) << (B * p)) * 0x00010001u);",
        ),
        "output plane 1's factor not undone": (
            "exp2i(kSub ? 24 - k_run - (kC8 ? 0 : CB) : -k_run)",
            "exp2i(kSub ? 24 - k_run : -k_run)",
        ),
        "BF16 pages: out-of-range rows kept": ("if (tok < tok_lo || tok >= tok_hi)", "if (false)", "mla_sm90_bf16.cuh"),
        # the T formats' instantiation (one content scale per token: C4R4T / C2R4T; one content score accumulator)
        "T formats: score offset term dropped": (
            "+ sacc[slot(gr)][acc_idx(ri, c)], og * qsv[c]);",
            "+ sacc[slot(gr)][acc_idx(ri, c)], 0.f * qsv[c]);",
        ),
        "T formats: RoPE scores in the content accumulator": (
            "return kOneAcc ? (gr == 4 ? 1 : 0)",
            "return kOneAcc ? (gr == 4 ? 0 : 0)",
        ),
    },
    "ws": {
        "none (control: must pass)": ("", ""),
        "softmax scale +1%": (
            "ex2(fmaf(sc[ri][c], two_e, -ms))",
            "ex2(fmaf(sc[ri][c], two_e * 1.01f, -ms))",
            "mla_ws_score.cuh",
        ),
        "sink boundary +1 token": ("const int lo = p.sink;", "const int lo = p.sink + 1;", "decode_mla_sm90_ws.cu"),
        "local boundary -1 token": (
            "max(n - p.local, p.sink);",
            "max(n - p.local + 1, p.sink);",
            "decode_mla_sm90_ws.cu",
        ),
        "output offset term dropped": (
            "corr[gl][c] = fin[NH + (2 * j + gl) * NH + h];",
            "corr[gl][c] = 0.f * fin[NH + (2 * j + gl) * NH + h];",
            "mla_ws_output.cuh",
        ),
        "score magic term 1024 -> 1023": (
            "init = -fmaf(SUB ? 0.f : 1024.f, qm,",
            "init = -fmaf(SUB ? 0.f : 1023.f, qm,",
            "mla_swapab.cuh",
        ),
        "output code bias (fp16) one ulp off": (
            "(0x8000u | ((25u - B * p) << 10))",
            "(0x8001u | ((25u - B * p) << 10))",
            "mla_ops.cuh",
        ),
    },
    "hm": {  # the producer dequantizes (fp16 s c + o), the consumers run FlashMLA's loop with their own frames
        "none (control: must pass)": ("", ""),
        "softmax scale +1%": ("-INFINITY : s[i] * up;", "-INFINITY : s[i] * up * 1.01f;", "decode_mla_sm90_hm.cu"),
        "sink boundary +1 token": ("const int lo = p.sink;", "const int lo = p.sink + 1;", "decode_mla_sm90_hm.cu"),
        "local boundary -1 token": (
            "max(n - p.local, p.sink);",
            "max(n - p.local + 1, p.sink);",
            "decode_mla_sm90_hm.cu",
        ),
        "offset term dropped": (
            "ov[g] = orow >= 0 ? meta[orow * kPage + tok] :",
            "ov[g] = orow >= 0 ? __float2half(0.f) :",
            "decode_mla_sm90_hm.cu",
        ),
        "code magic subtracted one ulp too far (codes one off)": (
            'asm("sub.rn.f16x2 %0, %0, %1;\\n" : "+r"(v) : "r"(magic));',
            'asm("sub.rn.f16x2 %0, %0, %1;\\n" : "+r"(v) : "r"(magic + 0x00010001u));',
            "mla_hm.cuh",
        ),
        "the other consumer's P in a frame 1% off": (
            ": ex2(fo[v] - m_run[v]);",
            ": ex2(fo[v] - m_run[v] + 0.0144f);",
            "decode_mla_sm90_hm.cu",
        ),
    },
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=sorted(SOURCES), default="mma")
    ap.add_argument("--dry-run", action="store_true", help="resolve every pattern to its file; build and run nothing")
    args = ap.parse_args()
    kernel = args.kernel
    mutations = MUTATIONS[kernel]
    texts = {f.name: f.read_text() for f in sorted(CSRC.iterdir()) if f.suffix in (".cu", ".cuh")}
    # where this kernel's mutations may be: its source and the shared headers (not another kernel's own header,
    # e.g. the BF16 pages of the wgmma kernel, mla_sm90_bf16.cuh, whose boundaries read the same)
    own = {SOURCES[kernel]} | {f for f in texts if f.endswith(".cuh") and f not in OTHER_HEADERS}
    survived = []
    for name, (old, new, *only) in mutations.items():  # a third element: the one file the pattern is in
        where = [f for f, t in texts.items() if old and f in (set(only) or own) and old in t]
        if old and len(where) != 1:
            print(f"{name}: pattern found in {len(where)} kernel sources, not 1 (update the mutation list)")
            survived.append(name)
            continue
        if args.dry_run:
            print(f"{name}: {where[0] if where else '(control)'}")
            continue
        with tempfile.TemporaryDirectory() as d:
            for f, t in texts.items():  # the kernel sources, one of them mutated
                (Path(d) / f).write_text(t.replace(old, new) if where and f == where[0] else t)
            env = dict(os.environ, QUANTMLA_CUDA_SRC=d, QUANTMLA_CACHE=os.path.join(d, "cache"))
            env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                "-k", SELECT[kernel], str(ROOT / "tests" / "kernels" / "test_decode_cuda.py")],
                               env=env, capture_output=True, text=True)  # fmt: skip
            caught = r.returncode != 0 and "failed" in r.stdout
            why = [ln.strip() for ln in r.stdout.splitlines() if ln.startswith("E ")][:3]
            if not old:  # the control: the unmodified kernel must pass in this harness
                print(f"{name}: {'PASSED' if r.returncode == 0 else 'FAILED ' + ' | '.join(why)[:400]}", flush=True)
                if r.returncode != 0:
                    print(r.stdout[-3000:])
                    return 2
                continue
            print(f"{name}: {'CAUGHT' if caught else 'SURVIVED'}: {' | '.join(why)[:300]}", flush=True)
            if not caught:
                survived.append(name)
    if args.dry_run:
        print(f"{kernel}: {len(mutations) - 1 - len(survived)}/{len(mutations) - 1} patterns resolve to one file")
        return 1 if survived else 0
    print(f"{kernel}: {len(mutations) - 1 - len(survived)}/{len(mutations) - 1} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
