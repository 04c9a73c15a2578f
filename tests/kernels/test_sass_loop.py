"""``benchmarks/sass_loop.py`` on this machine's nvcc (skipped without one): it finds each packed format's page loop
(the HGMMA inside it), and the ``QMLA_SM90_P_STSM`` build writes the (P s)^T tiles as it says -- one stmatrix per
content group and no two-byte stores, where the default build has 32 -- with fewer instructions per tile."""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (pip install nvidia-cuda-nvcc)")


def _tool():
    spec = importlib.util.spec_from_file_location("sass_loop", os.path.join(HERE, "..", "..", "benchmarks",
                                                                            "sass_loop.py"))  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stmatrix_build_writes_the_p_tiles_with_one_instruction_per_group():
    sl = _tool()
    ops = {}
    for name, defines in (("base", []), ("pstsm", ["QMLA_SM90_P_STSM=1"])):
        sass = sl.compile_sass(defines)
        ops[name] = {f: collections.Counter(sl.opcode(x) for x in sl.loop_of(sass, f)) for f in sl.FORMATS}
    for f in sl.FORMATS:
        base, new = ops["base"][f], ops["pstsm"][f]
        assert base["HGMMA.64x16x16.F32"] == new["HGMMA.64x16x16.F32"] == 68  # 36 score + 32 output products
        assert base["STS.U16"] == 32 and new["STS.U16"] == 0, f
        assert sum(v for k, v in new.items() if k.startswith("STSM")) == 4, f  # 4 content groups
        assert sum(new.values()) < sum(base.values()) - 40, f
