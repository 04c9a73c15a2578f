"""benchmarks/bench_prefill.py runs on the CPU (tiny shapes), checks every path before timing it, and writes what it
promises."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_prefill.py"
ARGV = ["--tiny", "--contexts", "40,100", "--chunk", "32", "--reps", "1"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_prefill", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_checked_results(tmp_path, capsys):
    bench = _bench()
    argv = ARGV + ["--out", str(tmp_path)]
    assert bench.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    d = json.loads((tmp_path / "prefill_tiny.json").read_text())
    rows = {(r["impl"], r["format"], r["context"]): r for r in d["rows"]}
    for fmt in ("bf16", "c4r4"):
        for n, T in ((40, 8), (100, 4)):  # the last chunk of the prompt
            for impl in ("split", "sdpa"):
                r = rows[(impl, fmt, n)]
                assert r["ok"] and r["rel_err"] < 1e-2 and r["ms"] > 0 and r["queries"] == T
            assert rows[("split_vs_sdpa", fmt, n)]["rel_err"] < 1e-2
    assert summary["ok"]
    assert summary["split_c4r4_n100_ms"] == pytest.approx(rows[("split", "c4r4", 100)]["ms"], abs=1e-3)
    assert "| c4r4 | 100 | 4 |" in (tmp_path / "prefill_tiny.md").read_text() and d["meta"]["commit"]
    with pytest.raises(SystemExit, match="--force"):
        bench.main(argv)


def test_a_wrong_path_is_reported_not_timed(tmp_path, monkeypatch):
    bench = _bench()
    real = bench.prefill_attention

    def wrong_split(*a, impl, **kw):
        out = real(*a, impl=impl, **kw)
        return out * 1.1 if impl == "split" else out

    monkeypatch.setattr(bench, "prefill_attention", wrong_split)
    assert bench.main(ARGV + ["--formats", "c4r4", "--contexts", "40", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "prefill_tiny.json").read_text())["rows"]
    split = next(r for r in rows if r["impl"] == "split")
    assert not split["ok"] and "ms" not in split and split["rel_err"] == pytest.approx(0.1, rel=0.05)
    assert "CHECK FAIL" in (tmp_path / "prefill_tiny.md").read_text()
