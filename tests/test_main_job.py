"""`quantmla run` end to end on the tiny model: calibrate (smoke budget), score every cache, write JSON; compact
progress with the time left when stderr is not a terminal; the output ends with the results and the headline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import quantmla
from quantmla.calibrate.shipped import shipped_available
from quantmla.cli import main

TINY = ["run", "--tiny", "--tokens", "400", "--context", "200", "--preset", "smoke"]


def test_main_job_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = [*TINY, "--out", str(out)]
    assert main(argv) == 0
    d = json.loads(out.read_text())
    rows = {r["label"]: r for r in d["rows"]}
    assert set(rows) == {"BF16", "C8R8 RTN", "C4R8 RTN", "C4R4 RTN", "C2R4 RTN", "C4R4 QuantMLA"}
    # The unquantized cache reproduces the model's own forward; fewer bits lose more.
    assert rows["BF16"]["kl_to_full_precision"] == pytest.approx(0.0, abs=1e-6)
    assert rows["BF16"]["top1_agreement"] == 1.0
    assert 0 < rows["C8R8 RTN"]["kl_to_full_precision"] < rows["C4R4 RTN"]["kl_to_full_precision"]
    assert rows["C4R4 RTN"]["kl_to_full_precision"] < rows["C2R4 RTN"]["kl_to_full_precision"]
    # QuantMLA changes the weights, not the cache layout: same bytes as RTN at C4R4, fewer than BF16.
    assert rows["C4R4 QuantMLA"]["cache_bytes_bf16_model"] == rows["C4R4 RTN"]["cache_bytes_bf16_model"]
    assert rows["C4R4 RTN"]["cache_bytes_bf16_model"] < rows["BF16"]["cache_bytes_bf16_model"]
    assert d["calibration"]["config"]["steps_rope"] == 2 and d["summary"]["compression_this_model_32k"] > 3
    assert len(rows["BF16"]["window_nll"]) == 2 and d["summary"]["windows"] == 2
    assert "Accuracy kept" in capsys.readouterr().out
    assert main(argv) == 2  # never overwrite without --force
    assert "exists; pass --force" in capsys.readouterr().err


def test_main_job_rejects_windows_inside_the_local_window(capsys):
    assert main(["run", "--tiny", "--tokens", "256", "--context", "128", "--no-calibrate"]) == 2
    assert "sink + local" in capsys.readouterr().err


def test_main_job_log_is_compact_and_ends_with_the_headline():
    """stderr a pipe (a CI log): no tqdm refreshes, a time-left estimate; stdout ends with the results."""
    env = {**os.environ, "PYTHONPATH": str(Path(quantmla.__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "quantmla.cli", *TINY], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stderr and "left" in r.stderr
    assert len(r.stderr.splitlines()) < 40, r.stderr
    out = r.stdout.rstrip().splitlines()
    assert out[-2].startswith("== Accuracy kept (C4R4): QuantMLA ") and out[-1].startswith("   Perplexity")
    assert out[-3].startswith("== Memory saved") and out[-4].startswith("   C4R4 QuantMLA")


def test_main_job_shipped_transforms_of_another_conversion_are_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    """A shipped file whose base key is not this install's conversion: no row, a note saying why, model untouched."""
    import torch

    from quantmla import main_job
    from quantmla.calibrate import shipped
    from quantmla.mla.tiny import tiny_model

    monkeypatch.setattr(shipped, "DATA_DIR", tmp_path)
    shipped.save_transforms(tmp_path / "smollm2-mla-quantmla-c4r4.safetensors", {}, {"base_key": "another-conversion"})
    model = tiny_model("deepseek_v2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert main_job._shipped(model, "smollm2-mla", "c4r4") == (None, None)
    assert "shipped transforms not used" in capsys.readouterr().out
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert main_job._shipped(model, "smollm2-mla", "c2r4") == (None, None)  # none ships: nothing printed
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.skipif(("smollm2-mla", "c4r4") not in shipped_available(), reason="no shipped smollm2-mla C4R4")
def test_main_job_scores_the_shipped_transforms_beside_rtn(tmp_path, capsys):
    """The embedded model, live calibration skipped: the shipped C4R4 transforms get their own row on the same
    tokens, labelled with the file's budget, and they beat RTN's KL there (what they were calibrated for)."""
    from quantmla.calibrate.shipped import load_shipped

    out = tmp_path / "run.json"
    assert main(["run", "--tokens", "512", "--context", "256", "--formats", "bf16,c4r4", "--no-calibrate",
                 "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    rows = {r["label"]: r for r in d["rows"]}
    assert set(rows) == {"BF16", "C4R4 RTN", "C4R4 QuantMLA shipped"}
    assert rows["C4R4 QuantMLA shipped"]["kl_to_full_precision"] < rows["C4R4 RTN"]["kl_to_full_precision"]
    assert rows["C4R4 QuantMLA shipped"]["cache_bytes_bf16_model"] == rows["C4R4 RTN"]["cache_bytes_bf16_model"]
    _, meta = load_shipped("smollm2-mla", "c4r4")
    assert d["shipped"]["label"] == meta["label"] and d["shipped"]["calibration"] == meta["calibration"]
    assert meta["label"] in printed and "steps per layer" in printed  # the budget it was made with
    assert "== Shipped transforms (C4R4" in printed and "Recorded in the file" in printed
