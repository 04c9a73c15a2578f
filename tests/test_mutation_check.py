"""benchmarks/mutation_check.py's list stays in step with the kernel sources: every mutation's pattern occurs
exactly once where the harness looks for it (a pattern that moved or doubled would make the GPU run report a
stale list instead of testing the tests)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def mc():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("mutation_check")
    finally:
        sys.path.remove(str(BENCH))


def test_every_kernel_has_a_control_and_its_source(mc):
    assert set(mc.MUTATIONS) == set(mc.SOURCES) == set(mc.SELECT)
    for kernel, muts in mc.MUTATIONS.items():
        assert (mc.CSRC / mc.SOURCES[kernel]).is_file()
        assert muts["none (control: must pass)"] == ("", "")
        assert len(muts) >= 7, kernel


def test_every_pattern_occurs_once_where_the_harness_looks(mc):
    texts = {f.name: f.read_text() for f in mc.CSRC.iterdir() if f.suffix in (".cu", ".cuh")}
    for kernel, muts in mc.MUTATIONS.items():
        own = {mc.SOURCES[kernel]} | {f for f in texts if f.endswith(".cuh") and f not in mc.OTHER_HEADERS}
        for name, (old, new, *only) in muts.items():
            if not old:
                continue
            where = [f for f in (set(only) or own) if old in texts[f]]
            assert len(where) == 1 and texts[where[0]].count(old) == 1, (kernel, name, where)
            assert new != old
