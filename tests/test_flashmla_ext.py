"""benchmarks/flashmla_ext.py's prebuilt loader refuses what it cannot use with a message saying what to do (the
build itself needs a GPU machine and a FlashMLA checkout: benchmarks only)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from flashmla_ext import load_prebuilt  # noqa: E402


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        load_prebuilt(str(tmp_path / "flashmla_dense_bench.so"))


def test_a_file_that_is_no_extension_is_a_clear_error(tmp_path):
    bad = tmp_path / "flashmla_dense_bench.so"
    bad.write_bytes(b"not an ELF shared object")
    with pytest.raises(SystemExit, match="does not load here"):
        load_prebuilt(str(bad))
