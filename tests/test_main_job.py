"""`quantmla run` end to end on the tiny model: calibrate (smoke budget), score every cache, write JSON."""

import json

import pytest

from quantmla.cli import main


def test_main_job_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["run", "--tiny", "--tokens", "400", "--context", "200", "--preset", "smoke", "--out", str(out)]
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
    assert "Accuracy kept" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--force"):  # never overwrite without --force
        main(argv)


def test_main_job_rejects_windows_inside_the_local_window():
    with pytest.raises(SystemExit, match="sink \\+ local"):
        main(["run", "--tiny", "--tokens", "256", "--context", "128", "--no-calibrate"])
