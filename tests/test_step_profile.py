"""benchmarks/step_profile.py: its operator count is the program's own count, its table carries the rows, and its
prefill mode profiles a whole prompt's ingestion (ranges included) and leaves exactly the prompt in the cache."""

from __future__ import annotations

import contextlib
import json
import math
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


def test_prefill_profile_ingests_the_whole_prompt(tmp_path):
    """--smoke --prefill (tiny model, CPU): 300 tokens in forwards of 128, so the last chunk is a short one."""
    from quantmla.cache import layer

    assert isinstance(layer._profiled("quantmla.store"), contextlib.nullcontext)  # no range outside a profile
    assert sp.main(["--smoke", "--prefill", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "step_profile_smoke_prefill.json").read_text())
    assert (data["meta"]["mode"], data["meta"]["clock"], data["meta"]["layers"]) == ("prefill", "CPU", 2)
    rows = {r["format"]: r for r in data["rows"]}
    assert sorted(rows) == ["bf16", "c4r4", "hf"] and len(data["rows"]) == 3
    forwards = 2 * 3  # layers x chunks (128, 128, 44)
    for fmt, r in rows.items():
        assert (r["batch"], r["context"], r["chunk"], len(r["chunk_s"])) == (1, 300, 128, 3)
        assert r["cached_tokens"] == [300], f"{fmt}: the profiled ingestion left {r['cached_tokens']} tokens per layer"
        assert r["kernels"] > r["cpu_ops"] > 0 and r["device_ms"] > 0 and len(r["top_kernels"]) > 0
        assert math.isfinite(r["wall_s"]) and r["wall_s"] > 0 and all(math.isfinite(t) for t in r["chunk_s"])
        assert r["ranges"]["model.self_attn"]["calls"] == forwards and r["ranges"]["model.mlp"]["calls"] == forwards
        ours = {k: v["calls"] for k, v in r["ranges"].items() if k.startswith("quantmla.")}
        assert ours == ({} if fmt == "hf" else dict.fromkeys(sp.CACHE_RANGES, forwards)), fmt
        attn = r["ranges"]["model.self_attn"]["cpu_ms"]
        assert all(0 < v["cpu_ms"] <= attn for k, v in r["ranges"].items() if k.startswith("quantmla.")), fmt
    md = (tmp_path / "step_profile_smoke_prefill.md").read_text()
    assert all(f"| {fmt} | 300 | 128 | " in md for fmt in rows)
    assert not list(tmp_path.glob("*.tmp"))
