"""benchmarks/bench_graph_decode.py: the table's ratios are the measured times' ratios, and without a GPU it stops
with a clear message."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_graph_decode as bgd  # noqa: E402


def test_table_ratios(tmp_path):
    meta = {"device": "dev", "date": "d", "commit": "c", "command": "cmd", "model": "m", "ok": True}
    checks = [{"format": "c4r4", "rel_logits": 1e-3, "tokens_equal": True, "ok": True}]
    rows = [{"format": f, "batch": 32, "context": 32768, "eager_ms": e, "graph_ms": g, "speedup": e / g,
             "capture_s": 1.0, "tok_s": 32 / (g / 1e3)} for f, e, g in (("bf16", 66.0, 16.0), ("c4r4", 63.0, 12.0))]
    bgd.write(str(tmp_path / "graph_decode_t"), meta, checks, rows)
    md = (tmp_path / "graph_decode_t.md").read_text()
    assert "| c4r4 | 32 x 32768 | 63.00 | 12.00 | 5.25x | 2667 | 0.75x |" in md
    assert "c4r4 tokens equal, logits rel 1.0e-03" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench_graph_decode.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bgd.main()
