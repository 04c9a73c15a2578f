"""What the Hopper decode kernel's main loop is made of, without a GPU: compile ``decode_mla_sm90.cu`` for sm_90a
(nvcc), disassemble it (cuobjdump), and per packed format count the SASS instructions of the page loop -- the
largest backward branch whose body holds the HGMMA -- by opcode. Static counts: the lazy rescaling branch inside
the loop (taken on few tiles) is counted once like everything else.

    python benchmarks/sass_loop.py                                    # today's defaults, top 25 opcodes
    python benchmarks/sass_loop.py -D QMLA_SM90_P_STSM=1 --top 40      # a variant's macros (as kernel_variants.py)

Needs nvcc >= 12 and cuobjdump (a CUDA toolkit, or the copy inside Triton's NVIDIA backend, found on its own).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "quantmla", "kernels", "csrc")
# (content bits, RoPE bits, content symmetric, RoPE symmetric, one content scale per token): the instantiation each
# format's cache uses
FORMATS = {"c4r4": (4, 4, 0, 0, 0), "c2r4": (2, 4, 0, 0, 0), "c8r8": (8, 8, 1, 1, 0), "c4r8": (4, 8, 0, 1, 0),
           "c4r4t": (4, 4, 0, 0, 1), "c2r4t": (2, 4, 0, 0, 1)}  # fmt: skip


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    hits = glob.glob(os.path.join(os.path.dirname(os.__file__), "site-packages", "triton", "backends", "nvidia",
                                  "bin", "cuobjdump"))  # fmt: skip
    if not hits:
        sys.exit("cuobjdump not found: install a CUDA toolkit (or triton, which ships one in backends/nvidia/bin)")
    return hits[0]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0]


def main_loop(sass: str, function: str) -> list[str]:
    """The instructions of the largest loop (backward branch) of ``function`` that contains an HGMMA."""
    block = next((b for b in re.split(r"\n\s*Function : ", sass) if b.startswith(function)), None)
    if block is None:
        raise SystemExit(f"{function} not in the disassembly")
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln) for ln in block.splitlines()) if m]  # fmt: skip
    where = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] = []
    for i, (a, text) in enumerate(ins):
        if not opcode(text).startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        t = int(m.group(1), 16) if m else None
        if t is not None and t < a and t in where:
            body = [x for _, x in ins[where[t] : i + 1]]
            if any(opcode(x).startswith("HGMMA") for x in body) and len(body) > len(best):
                best = body
    return best


def compile_sass(defines: list[str]) -> str:
    """The disassembly of decode_mla_sm90.cu built for sm_90a with these macros (``NAME=VALUE``)."""
    nvcc = shutil.which("nvcc") or sys.exit("nvcc not found: pip install nvidia-cuda-nvcc (>= 12)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        cmd = [nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o", cubin,
               *(f"-D{d}" for d in defines), os.path.join(CSRC, "decode_mla_sm90.cu")]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        return subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout


def loop_of(sass: str, fmt: str) -> list[str]:
    """The main loop of the packed format's instantiation (``FORMATS``)."""
    cb, rb, cs, rs, ts = FORMATS[fmt]
    return main_loop(sass, f"_ZN4qmla4sm9018decode_kernel_sm90ILi{cb}ELi{rb}ELb{cs}ELb{rs}ELi16ELb{ts}E")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro, e.g. QMLA_SM90_P_STSM=1")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--top", type=int, default=25, help="opcodes listed per format")
    args = ap.parse_args(argv)
    bad = [f for f in args.formats.split(",") if f not in FORMATS]
    if bad:
        raise SystemExit(f"unknown format(s) {bad}: one of {list(FORMATS)}")
    sass = compile_sass(args.defines)
    print(f"decode_mla_sm90.cu main loop, SASS instructions per warp and 64-token tile (static); defines: "
          f"{' '.join(args.defines) or 'none'}")  # fmt: skip
    for name in args.formats.split(","):
        body = loop_of(sass, name)
        counts = collections.Counter(opcode(x).split(".")[0] for x in body)
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(args.top))
        print(f"{name}: {len(body)} -- {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
