"""The one-stream decode order (cuda_decode.launch_decode with a library built with QMLA_PDL) relies on the Triton
BF16 buffer kernel letting the next kernel of the stream start: compiled ahead of time for sm_90 (no GPU needed; in
a process of its own, since this directory's tests run Triton's interpreter), its PTX has
griddepcontrol.launch_dependents with GDC and not without."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
SCRIPT = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantmla.kernels.triton_decode import _buffers_kernel
names = _buffers_kernel.arg_names
types = {"QL": "*bf16", "QP": "*bf16", "SINKB": "*bf16", "LOCB": "*bf16", "LENS": "*i32", "PO": "*fp32",
         "PL": "*fp32", "qk_scale": "fp32"}
out = {}
for gdc in (False, True):
    consts = {"BLOCK_N": 64, "DC": 512, "DR": 64, "BLOCK_H": 16, "SINK": 4, "LOCAL": 128, "INTERP": False, "GDC": gdc}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=_buffers_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    out[str(gdc)] = "griddepcontrol.launch_dependents" in ptx
print(json.dumps(out))
"""


def test_buffer_kernel_lets_the_next_kernel_launch_only_when_asked():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"False": False, "True": True}


def test_one_stream_order_only_when_the_buffer_kernel_comes_right_before():
    """The page kernel may wait for its predecessor only at its end when that predecessor is the buffer kernel (it
    writes nothing the page kernel reads); any other way -- no programmatic library, the buffer kernel not launched,
    or launching nothing because there are no buffer tiles -- it must wait at its start (pdl_late stays 0)."""
    import dataclasses

    from quantmla.kernels.cuda_decode import PARTS, DecodePlan, one_stream_order

    fields = {f.name: None for f in dataclasses.fields(DecodePlan)}
    plan = DecodePlan(**{**fields, "ns": 8, "ns_total": 10, "one_stream": True})
    assert one_stream_order(plan, PARTS)
    assert one_stream_order(plan, ("buffers", "pages"))
    assert not one_stream_order(plan, ("pages", "combine"))
    assert not one_stream_order(plan, ("buffers", "combine"))
    assert not one_stream_order(dataclasses.replace(plan, ns_total=8), PARTS)  # no buffer tiles: nothing launched
    assert not one_stream_order(dataclasses.replace(plan, one_stream=False), PARTS)


def test_the_page_kernel_merges_only_where_the_buffer_partials_are_complete():
    """The merge in the page kernel (QMLA_FUSED_MERGE) reads the BF16 buffer kernel's partials at the page kernel's
    end: only in the one-stream order (the page kernel waited for the buffer kernel) or with no buffer slots, with
    every part launched, and only for a plan made for it (a library built with it, few slots)."""
    import dataclasses

    from quantmla.kernels.cuda_decode import PARTS, DecodePlan, fused_merge

    fields = {f.name: None for f in dataclasses.fields(DecodePlan)}
    plan = DecodePlan(**{**fields, "ns": 8, "ns_total": 10, "one_stream": True, "fused": True})
    assert fused_merge(plan, PARTS)
    assert not fused_merge(dataclasses.replace(plan, fused=False), PARTS)
    assert not fused_merge(dataclasses.replace(plan, one_stream=False), PARTS)  # buffers on a side stream
    assert fused_merge(dataclasses.replace(plan, one_stream=False, ns_total=8), PARTS)  # no buffer slots
    assert not fused_merge(plan, ("buffers", "pages"))  # timing the parts apart: the merge kernel's part
