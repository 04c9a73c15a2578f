"""benchmarks/decode_breakdown.py: the per-CTA fit recovers a line it is given, the tables carry the measured
numbers, and without a GPU it stops with a clear message; launch_decode names a bad part."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import decode_breakdown as db  # noqa: E402


def test_fit_recovers_a_line_and_a_noisy_one():
    ks = [1, 2, 4, 8, 16, 32]
    a, b = db.fit(ks, [33.0 + 2.7 * k for k in ks])
    assert a == pytest.approx(33.0) and b == pytest.approx(2.7)
    g = torch.Generator().manual_seed(0)
    noisy = [33.0 + 2.7 * k + float(torch.randn(1, generator=g)) * 0.1 for k in ks]
    a, b = db.fit(ks, noisy)
    # least squares against float64 normal equations
    X = torch.tensor([[1.0, k] for k in ks], dtype=torch.float64)
    sol = torch.linalg.lstsq(X, torch.tensor(noisy, dtype=torch.float64)[:, None]).solution[:, 0]
    assert a == pytest.approx(float(sol[0]), abs=1e-9) and b == pytest.approx(float(sol[1]), abs=1e-9)


def test_tables_carry_the_numbers(tmp_path):
    meta = {"device": "dev", "date": "d", "commit": "c", "command": "cmd", "timer_floor_us": 4.5, "ok": True}
    parts = [{"format": "c4r4", "batch": 32, "context": 4096, "kernel": "wgmma", "splits": 8, "all_us": 58.25,
              "pages_us": 40.5, "buffers_us": 9.0, "combine_us": 6.0, "pages+combine_us": 47.0}]  # fmt: skip
    sweep = [{"format": "c4r4", "batch": 32, "splits": 8, "pages_per_cta": k, "all_us": 30.0 + 3 * k,
              "pages_us": 20.0 + 3 * k} for k in (1, 2)]  # fmt: skip
    fits = [{"format": "c4r4", "all_fixed_us": 30.0, "all_per_page_us": 3.0, "pages_fixed_us": 20.0,
             "pages_per_page_us": 3.0}]  # fmt: skip
    splits = [{"format": "c4r4", "batch": 1, "context": 131072, "kernel": "wgmma", "splits": 128, "all_us": 61.5}]
    db.write(str(tmp_path / "decode_breakdown_t"), meta, parts, sweep, fits, splits)
    md = (tmp_path / "decode_breakdown_t.md").read_text()
    assert "| c4r4 | 32 x 4096 | wgmma | 8 | 58.2 | 40.5 | 9.0 | 6.0 | 47.0 |" in md
    assert "| c4r4 | 30.0 | 3.00 | 20.0 | 3.00 |" in md and "| c4r4 | 1 x 131072 | wgmma | 128 | 61.5 |" in md
    doc = json.loads((tmp_path / "decode_breakdown_t.json").read_text())
    assert doc["sweep"][1]["all_us"] == 36.0 and doc["meta"]["timer_floor_us"] == 4.5
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["decode_breakdown.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        db.main()


def test_launch_decode_names_a_bad_part():
    from quantmla.kernels.cuda_decode import DecodePlan, launch_decode

    plan = DecodePlan(*([None] * 14))
    with pytest.raises(ValueError, match="parts must be among"):
        launch_decode(plan, ("pages", "everything"))


def test_main_runs_every_section_and_writes_both_files(monkeypatch, tmp_path):
    """The script's flow without a GPU: the timer, the plans and the checks replaced by stand-ins; every section's
    rows reach the files, a failed check makes the exit code 1."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(db.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(db.torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(db, "Timer", lambda: (lambda fn, reps: 10.0))
    monkeypatch.setattr(db, "timer_floor", lambda timer, reps: 3.0)

    def setup(fmt, H, B, N, kernel, splits, seed):
        calls.append((fmt, B, N, splits))
        plan = SimpleNamespace(kernel="wgmma", ns=splits or 8, ns_total=(splits or 8) + 3)
        return plan, {"rel": 1e-4, "lse_err": 1e-4, "ok": not (B == 1 and splits == 512)}

    monkeypatch.setattr(db, "setup", setup)
    monkeypatch.setattr(sys, "argv", ["decode_breakdown.py", "--formats", "c4r4", "--shapes", "1x131072",
                                      "--pages", "1,2", "--out", str(tmp_path), "--tag", "t"])  # fmt: skip
    assert db.main() == 1  # the 512-split check failed
    doc = json.loads((tmp_path / "decode_breakdown_t.json").read_text())
    assert [r["batch"] for r in doc["parts"]] == [1] and doc["parts"][0]["pages+combine_us"] == 10.0
    assert [r["pages_per_cta"] for r in doc["sweep"]] == [1, 2] and doc["fits"][0]["all_per_page_us"] == 0.0
    assert [r["splits"] for r in doc["splits"]] == [4, 8, 16, 128, 256, 512] and not doc["meta"]["ok"]
    assert ("c4r4", 32, 64 * 8 * 2, 8) in calls  # the sweep: 2 pages per CTA at 8 splits of 32 sequences
