"""Compile the decode/writer Triton kernels for sm_90 without a GPU and print registers, spills, shared memory.

Lets us catch compile errors and register spills on a CPU machine before spending GPU time::

    python benchmarks/compile_decode.py [--warps 8] [--stages 2] [--block-n 64] [--writer] [--sass]

For the H200's Triton (3.6), put its wheel first on the path:
``pip install --no-deps --target /tmp/tr36 triton==3.6.0 && PYTHONPATH=/tmp/tr36:src python benchmarks/...``
(Triton 3.6 rejects some programs that 3.9 accepts, e.g. constexpr branches returning different shapes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quantmla.kernels import triton_decode, triton_writer
from quantmla.kernels.paged import PagedLayout
from quantmla.quant.formats import get_format

PTR = {
    "QL": "*bf16", "QP": "*bf16", "POOL8": "*u8", "POOL16": "*fp16", "POOLBF": "*bf16", "BT": "*i32", "LENS": "*i32",
    "SINKB": "*bf16", "LOCB": "*bf16", "PO": "*fp32", "PL": "*fp32", "O": "*fp32", "LSE": "*fp32", "C": "*bf16",
    "KP": "*bf16", "START": "*i32", "NNEW": "*i32",
}  # fmt: skip
FLOATS = {"qk_scale"}
# integer arguments that the JIT sees divisible by 16 at the benchmark shapes (16 heads, contiguous q, page-table
# widths and buffer strides that are multiples of 16) and therefore specializes as such; pointers are 16-aligned.
DIV16 = {"stride_qlb", "stride_qlh", "stride_qpb", "stride_qph", "stride_bt", "stride_sb", "stride_lb", "H", "SP_OFF"}


def compile_kernel(fn, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in PTR:
            sig[name] = PTR[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    # the JIT's specialization: without these hints the compile assumes byte alignment and emits scalar loads
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in DIV16}  # fmt: skip
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    opts = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _cuobjdump(k, flag: str) -> str:
    """Triton's bundled ``cuobjdump FLAG`` on a compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def resources(k) -> str:
    """Registers / stack / local memory / shared memory of a compiled kernel (``cuobjdump -res-usage``)."""
    out = _cuobjdump(k, "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        return f"smem={k.metadata.shared} (no resource report)"
    return f"regs={m[1]} stack={m[2]} local={m[4]} smem={k.metadata.shared}"


def sass_mix(k) -> str:
    """Static SASS instruction mix of the kernel's main (longest) loop: total, HMMA share and the top opcodes."""
    sass = _cuobjdump(k, "-sass")
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    loops = []
    for addr, txt in ins:
        m = re.match(r"BRA\b.*?(0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    if not loops:
        return "no loop found"
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    ops: dict[str, int] = {}
    for addr, txt in ins:
        if lo <= addr <= hi:
            op = txt.split()[0]
            key = op if op.split(".")[0] in ("LDS", "STS", "LDG", "STG", "LDSM", "SHFL") else op.split(".")[0]
            ops[key] = ops.get(key, 0) + 1
    total = sum(ops.values())
    hmma = sum(v for o, v in ops.items() if o.startswith("HMMA"))
    top = ", ".join(f"{o} {v}" for o, v in sorted(ops.items(), key=lambda x: -x[1])[:24])
    return f"loop {total} instr/warp/iteration, HMMA {hmma} ({100 * hmma / max(1, total):.1f}%): {top}"


def decode_constexprs(fmt_name: str, block_n: int) -> dict:
    fmt = get_format(fmt_name)
    L = PagedLayout(fmt)
    c = triton_decode._spec_args(fmt.content, 512, L.content_scale_row, L.content_offset_row)
    r = triton_decode._spec_args(fmt.rope, 64, L.rope_scale_row, L.rope_offset_row)
    return dict(
        PAGE_BYTES=L.page_bytes, C_OFF=L.content_offset, R_OFF=L.rope_offset, M_OFF=L.meta_offset, P=64,
        BLOCK_N=block_n, DC=512, DR=64, BLOCK_H=16, QUANT=fmt.is_quantized, CBITS=c[0], CSYM=c[1], CG=c[2],
        CSROW=c[3], COROW=c[4], RBITS=r[0], RSYM=r[1], RG=r[2], RSROW=r[3], ROROW=r[4],
        SINK=4 if fmt.is_quantized else 0, LOCAL=128 if fmt.is_quantized else 0, INTERP=False,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--formats", default="bf16,c8r8,c4r8,c4r4,c2r4")
    ap.add_argument("--writer", action="store_true")
    ap.add_argument("--sass", action="store_true", help="also print the SASS instruction mix of the main loop")
    a = ap.parse_args()
    for f in a.formats.split(","):
        k = compile_kernel(triton_decode._decode_kernel, decode_constexprs(f, a.block_n), a.warps, a.stages)
        print(f"decode {f:5s} warps={a.warps} stages={a.stages} block_n={a.block_n}: {resources(k)}")
        if a.sass:
            print(f"    {sass_mix(k)}")
    k = compile_kernel(triton_decode._combine_kernel, {"DC": 512, "DCP": 512, "NSP": 16}, 4, 1)
    print(f"combine: {resources(k)}")
    if a.writer:
        for f in a.formats.split(","):
            fmt = get_format(f)
            L = PagedLayout(fmt)
            c = triton_writer._path_args(fmt.content, 512, L.content_scale_row, L.content_offset_row)
            r = triton_writer._path_args(fmt.rope, 64, L.rope_scale_row, L.rope_offset_row)
            ce = dict(
                PAGE_BYTES=L.page_bytes, C_OFF=L.content_offset, R_OFF=L.rope_offset, M_OFF=L.meta_offset, P=64,
                DC=512, DR=64, CBITS=c[0], CGROUP=c[1], CSYM=c[2], CSROW=c[3], COROW=c[4], RBITS=r[0],
                RGROUP=r[1], RSYM=r[2], RSROW=r[3], ROROW=r[4], CWP=c[5], RWP=r[5], DCP=512, DRP=64, SINK=4,
                LOCAL=128,
            )  # fmt: skip
            k = compile_kernel(triton_writer._writer_kernel, ce, 4, 1)
            print(f"writer {f:5s}: {resources(k)}")


if __name__ == "__main__":
    main()
