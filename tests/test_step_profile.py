"""benchmarks/step_profile.py: its operator count is the program's own count, and its table carries the rows."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import step_profile as sp  # noqa: E402


def test_top_level_ops_counts_what_the_program_called():
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            x = torch.add(x, 1.0)
        for _ in range(2):
            x = torch.mul(x, 2.0)
        torch.nn.functional.linear(x[None], torch.eye(8))  # calls aten ops of its own: counted once, as linear
    ops = sp.top_level_ops(prof.events())
    assert ops["aten::add"] == 3 and ops["aten::mul"] == 2 and ops["aten::linear"] == 1
    assert "aten::addmm" not in ops and "aten::t" not in ops  # nested inside linear


def test_table_carries_the_rows(tmp_path):
    meta = {"device": "dev", "date": "d", "commit": "c", "command": "cmd", "model": "m", "layers": 27}
    rows = [{"format": "c4r4", "batch": 32, "context": 32768, "wall_ms": 63.0, "cpu_ops": 3375, "top_ops": [],
             "kernels": 4000, "gpu_ms": 21.0, "ours_ms": 5.7, "top_kernels": []}]  # fmt: skip
    sp.write(str(tmp_path / "step_profile_t"), meta, rows)
    md = (tmp_path / "step_profile_t.md").read_text()
    assert "| c4r4 | 32 x 32768 | 63.00 | 3375 | 4000 | 21.00 | 5.70 | 0.33 |" in md
    assert not list(tmp_path.glob("*.tmp"))
