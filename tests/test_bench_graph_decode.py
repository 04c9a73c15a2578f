"""benchmarks/bench_graph_decode.py: the table's ratios are the measured times' ratios, and without a GPU it stops
with a clear message."""

from __future__ import annotations

import json
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


def test_main_flow_and_exit_code(monkeypatch, tmp_path):
    """Without a GPU, the model, the check and the timing replaced by stand-ins: every format that fits gets a row,
    one that does not is skipped, a failed check makes the exit code 1."""
    monkeypatch.setattr(bgd.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bgd.torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(bgd.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bgd.bg, "build_model", lambda name, device: (object(), "stand-in model"))
    monkeypatch.setattr(bgd, "check", lambda model, fmt: {"format": fmt, "rel_logits": 0.0,
                                                          "tokens_equal": fmt != "c2r4", "ok": fmt != "c2r4"})
    monkeypatch.setattr(bgd.bg, "fits", lambda model, fmt, B, n, device: (not (fmt == "bf16" and n > 4096), 1.0))
    monkeypatch.setattr(bgd, "time_format", lambda model, fmt, B, n, steps: {
        "format": fmt, "batch": B, "context": n, "eager_ms": 60.0, "graph_ms": 15.0, "speedup": 4.0, "capture_s": 1.0,
        "tok_s": B / 0.015})  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["bench_graph_decode.py", "--formats", "bf16,c4r4,c2r4", "--shapes",
                                      "32x32768,1x4096", "--out", str(tmp_path), "--tag", "t"])  # fmt: skip
    assert bgd.main() == 1
    doc = json.loads((tmp_path / "graph_decode_t.json").read_text())
    got = [(r["format"], r["batch"]) for r in doc["rows"]]
    assert got == [("c4r4", 32), ("c2r4", 32), ("bf16", 1), ("c4r4", 1), ("c2r4", 1)]
    assert not doc["meta"]["ok"]
