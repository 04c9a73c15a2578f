"""benchmarks/bench_generate.py runs end to end on the CPU (smoke mode) and writes what it promises."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_checked_results(tmp_path, capsys):
    bench = _bench()
    argv = ["--tiny", "--formats", "hf,bf16,c4r4", "--batches", "2", "--contexts", "400", "--prefill-contexts", "40",
            "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    d = json.loads((tmp_path / "generate_tiny.json").read_text())
    rows = d["rows"]
    checks = {r["format"]: r for r in rows if r["kind"] == "check"}
    assert set(checks) == {"bf16", "c4r4"} and all(r["ok"] for r in checks.values())
    dec = {r["format"]: r for r in rows if r["kind"] == "decode"}
    assert set(dec) == {"hf", "bf16", "c4r4"} and all(r["tpot_ms"] > 0 for r in dec.values())
    assert dec["c4r4"]["cache_bytes"] < dec["bf16"]["cache_bytes"]  # at 400 tokens the pages outweigh the buffers
    budget = {r["format"]: r for r in rows if r["kind"] == "budget"}
    assert budget["c4r4"]["max_batch"] > budget["bf16"]["max_batch"] > 0
    assert all(r["fits"] and r["allocated_bytes"] <= r["budget_bytes"] for r in budget.values())
    assert summary["tiny_c4r4_budget_vs_bf16"] == budget["c4r4"]["max_batch"] / budget["bf16"]["max_batch"]
    md = (tmp_path / "generate_tiny.md").read_text()
    assert "| 2 | 400 |" in md and d["meta"]["commit"]
    with pytest.raises(SystemExit, match="--force"):
        bench.main(argv)


def test_stopped_run_writes_what_it_measured(tmp_path, capsys, monkeypatch):
    """A run stopped mid-way (SIGTERM from `timeout` raises Stopped) still writes the rows measured before, marked
    partial, and exits non-zero; the SIGTERM handler is put back."""
    import signal

    bench = _bench()
    before = signal.getsignal(signal.SIGTERM)

    def stop(*a, **k):
        assert signal.getsignal(signal.SIGTERM) is bench._on_sigterm  # installed while measuring
        raise bench.Stopped("signal 15")

    monkeypatch.setattr(bench, "time_decode", stop)
    argv = ["--tiny", "--formats", "bf16", "--batches", "1", "--contexts", "40", "--out", str(tmp_path)]
    assert bench.main(argv) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["partial"] == "stopped by signal 15 during tiny"
    d = json.loads((tmp_path / "generate_tiny.json").read_text())
    assert [r["kind"] for r in d["rows"]] == ["check", "budget"] and d["meta"]["partial"]  # measured before decode
    assert "Partial run" in (tmp_path / "generate_tiny.md").read_text()
    assert signal.getsignal(signal.SIGTERM) is before


def test_device_comparison_smoke(tmp_path, capsys):
    """benchmarks/generate_devices.py on two CPU copies of a tiny model: identical tokens, zero logit difference."""
    spec = importlib.util.spec_from_file_location("generate_devices", BENCH.parent / "generate_devices.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--tiny", "--devices", "cpu,cpu", "--formats", "c2r4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate_devices_tiny.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["identical"] and r["max_logit_diff"] == 0 and not r["flips"] for r in rows)


def test_gpu_session_script_plumbing(tmp_path):
    """benchmarks/gpu_session_issue10.sh with PY=echo (a dry run): the chosen steps run in order with their
    arguments, each gets a summary line and a log, the bundle for the device tool holds them; a step that the time
    budget cannot cover is skipped with a line saying so."""
    import shutil
    import subprocess
    import tarfile

    (tmp_path / "repo" / "benchmarks").mkdir(parents=True)  # a copy: never this checkout's carries or /root/keep
    for f in ("gpu_session_issue10.sh", "device_carry.sh"):
        shutil.copy(BENCH.parent / f, tmp_path / "repo" / "benchmarks" / f)
    script = tmp_path / "repo" / "benchmarks" / "gpu_session_issue10.sh"
    out, res = tmp_path / "out", tmp_path / "issue10"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PY": "echo", "OUT": str(out), "HOME": str(tmp_path),
           "QUANTMLA_KEEP": str(tmp_path / "keep")}
    subprocess.run(["bash", str(script), str(res), "tests,v2lite"], env=env, check=True, capture_output=True)
    summary = (res / "summary.txt").read_text()
    assert "tests: ok" in summary and "v2lite: ok" in summary and "devices" not in summary
    assert "--tag h200_v2lite_32k" in (res / "v2lite.log").read_text()
    with tarfile.open(out / "issue10.tgz") as t:
        assert {"issue10/summary.txt", "issue10/tests.log", "issue10/v2lite.log"} <= set(t.getnames())
    assert (out / "issue10_summary.txt").read_text() == summary
    env["QUANTMLA_GPU_BUDGET_S"] = "20"
    subprocess.run(["bash", str(script), str(tmp_path / "late"), "tests"], env=env, check=True, capture_output=True)
    assert "tests: SKIPPED" in (tmp_path / "late" / "summary.txt").read_text()


def test_chunked_prefill_times_every_chunk(tmp_path, capsys):
    """--prefill-chunk: a 200-token prompt in forwards of 64 tokens -> four timed chunks summing to the row's time."""
    argv = ["--tiny", "--formats", "c4r4", "--batches", "1", "--contexts", "40", "--prefill-contexts", "200",
            "--prefill-chunk", "64", "--out", str(tmp_path)]  # fmt: skip
    assert _bench().main(argv) == 0
    rows = json.loads((tmp_path / "generate_tiny.json").read_text())["rows"]
    (pre,) = [r for r in rows if r["kind"] == "prefill"]
    assert pre["chunk"] == 64 and len(pre["chunk_seconds"]) == 4 and all(t > 0 for t in pre["chunk_seconds"])
    assert pre["seconds"] == pytest.approx(sum(pre["chunk_seconds"]))
    assert "forwards of 64 tokens" in (tmp_path / "generate_tiny.md").read_text()


def test_graph_needs_cuda_and_writes_nothing(tmp_path):
    bench = _bench()
    with pytest.raises(SystemExit, match="needs --device cuda"):
        bench.main(["--tiny", "--graph", "--device", "cpu", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_report_has_the_captured_table_with_ratios_to_bf16():
    import importlib.util as iu

    spec = iu.spec_from_file_location("bench_generate_report", BENCH.parent / "bench_generate_report.py")
    rep = iu.module_from_spec(spec)
    spec.loader.exec_module(rep)
    rows = [{"model": "m", "kind": "decode", "format": f, "batch": 8, "context": 4096, "tpot_ms": e, "tok_s": 8e3 / e,
             "graph_tpot_ms": g, "graph_tok_s": 8e3 / g} for f, e, g in (("bf16", 90.0, 20.0), ("c4r4", 80.0, 15.0))]
    rows.append({"model": "m", "kind": "decode", "format": "hf", "batch": 8, "context": 4096, "tpot_ms": 500.0,
                 "tok_s": 16.0})  # fmt: skip
    meta = {"device": "d", "date": "t", "commit": "c", "command": "x"}
    md = rep.markdown(meta, [{"model": "m", "description": "tiny", "params": 1e9, "dtype": "bf16"}], rows)
    captured = md.split("captured in a CUDA graph")[1]
    assert "| batch | context | bf16 | c4r4 |" in captured  # hf (transformers' cache) is never captured
    assert f"| 8 | 4096 | 20.00 (400/s) | 15.00 (533/s, {15.0 / 20.0:.2f}x) |" in captured
    rows.append({"model": "m", "kind": "decode", "format": "c2r4", "batch": 8, "context": 4096, "tpot_ms": 85.0,
                 "tok_s": 8e3 / 85.0, "graph_skipped": "layers [3] would run the torch reference"})  # fmt: skip
    md = rep.markdown(meta, [{"model": "m", "description": "tiny", "params": 1e9, "dtype": "bf16"}], rows)
    assert "Not captured in a CUDA graph: layers [3] would run the torch reference" in md  # said, not dropped
    assert "| batch | context | bf16 | c4r4 |" in md.split("captured in a CUDA graph")[1]  # c2r4 has no captured cell
