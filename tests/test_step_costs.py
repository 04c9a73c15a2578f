"""benchmarks/step_costs.py: bench_generate rows -> the StepCosts JSON serve_table10 --costs reads. The fit recovers
costs that generated the rows (times computed here by counting every step's tokens and attended positions one by
one), it is the nonnegative least-squares optimum, and a real tiny CPU run converts and loads."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from quantmla.serve.throughput import StepCosts, job_time

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TRUE = {  # a, b, p, c per format (seconds): the costs that make the synthetic rows
    "bf16": (0.020, 2e-5, 4e-10, 3e-9),
    "c4r4": (0.021, 2.1e-5, 6e-10, 1.5e-9),
}


def _mod(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _step_time(fmt, queries):
    """queries: the positions of the step's new tokens (position s attends to s + 1 tokens) and whether each is a
    decode token; summed one query at a time."""
    a, b, p, c = TRUE[fmt]
    t = a
    for pos, decode in queries:
        t += b + (c if decode else p) * (pos + 1)
    return t


def _results(path, decode_shapes, prefills, extra_rows=()):
    rows = []
    for fmt in TRUE:
        for bsz, ctx in decode_shapes:
            t = _step_time(fmt, [(ctx, True)] * bsz)
            rows.append({"model": "m", "kind": "decode", "format": fmt, "batch": bsz, "context": ctx,
                         "tpot_ms": 1e3 * t, "tok_s": bsz / t})  # fmt: skip
        for n, chunk in prefills:
            starts = range(0, n, chunk or n)
            times = [_step_time(fmt, [(q, False) for q in range(s, min(n, s + (chunk or n)))]) for s in starts]
            row = {"model": "m", "kind": "prefill", "format": fmt, "batch": 1, "context": n, "seconds": sum(times)}
            rows.append({**row, "chunk": chunk, "chunk_seconds": times} if chunk else row)
    rows += list(extra_rows)
    meta = {"device": "test", "date": "today", "commit": "abc", "command": "x"}
    path.write_text(json.dumps({"meta": meta, "models": [{"model": "m", "description": "synthetic", "params": 1,
                                                          "dtype": "bf16"}], "rows": rows}))  # fmt: skip
    return path


def test_fit_recovers_the_generating_costs(tmp_path):
    sc = _mod("step_costs")
    slow_b32 = [{"model": "m", "kind": "decode", "format": f, "batch": 32, "context": 4096, "tpot_ms": 1e3}
                for f in TRUE]  # above --max-decode-batch: reported, not fitted (it would wreck the fit)
    p1 = _results(tmp_path / "a.json", [(1, 4096), (8, 4096), (1, 32768), (8, 32768)], [(4096, 0)], slow_b32)
    p2 = _results(tmp_path / "b.json", [(5, 131072)], [(32768, 8192)])
    out = tmp_path / "costs.json"
    assert sc.main([str(p1), str(p2), "--model", "m", "--formats", "bf16,c4r4", "--out", str(out)]) == 0
    costs = StepCosts.from_json(out)
    for fmt, (a, b, p, c) in TRUE.items():
        got = (costs.cost("step_overhead_s", fmt), costs.cost("per_token_s", fmt), costs.cost("prefill_pair_s", fmt),
               costs.decode_cost(fmt))  # fmt: skip
        assert got == pytest.approx((a, b, p, c), rel=1e-8)
    # a Table-10-like trace priced with the fitted costs = the same steps timed query by query
    trace = [(8192, 8192 * 8192 + 8192 * 8193 // 2, 0, 0), (5, 0, 5, 5 * 131073)]
    want = _step_time("c4r4", [(q, False) for q in range(8192, 16384)]) + _step_time("c4r4", [(131072, True)] * 5)
    assert job_time(trace, costs, "c4r4", 5)[0] == pytest.approx(want, rel=1e-8)
    d = json.loads(out.read_text())
    b32 = [r for r in d["fit"]["bf16"]["rows"] if r["what"] == "decode B32 x 4096"]
    assert len(b32) == 1 and not b32[0]["used"] and abs(b32[0]["rel_err"]) > 0.9
    assert "synthetic" in d["label"] and d["fit"]["c4r4"]["max_abs_rel_err_fitted"] < 1e-8
    with pytest.raises(SystemExit, match="exists; pass --force"):
        sc.main([str(p1), "--model", "m", "--formats", "bf16", "--out", str(out)])


def test_too_few_rows_name_the_format(tmp_path):
    sc = _mod("step_costs")
    p = _results(tmp_path / "a.json", [(1, 4096), (8, 4096)], [])
    with pytest.raises(SystemExit, match="bf16: 2 usable rows .decode. cannot determine"):
        sc.main([str(p), "--model", "m", "--out", str(tmp_path / "c.json")])
    assert not (tmp_path / "c.json").exists()


def test_nonnegative_fit_is_the_constrained_optimum():
    """KKT conditions of min ||(x w - t) / t||^2, w >= 0, on data whose unconstrained optimum has a negative term."""
    sc = _mod("step_costs")
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 2.0, (12, 4))
    t = x @ np.array([1.0, -0.5, 2.0, 0.3]) + 3.0
    w = sc.nnls_relative(x, t)
    a = x / t[:, None]
    grad = a.T @ (a @ w - 1.0)
    free = w > 0
    assert (w >= 0).all() and (~free).any()
    assert np.abs(grad[free]).max() < 1e-9 and (grad[~free] >= -1e-9).all()


def test_a_tiny_cpu_run_converts_and_loads(tmp_path, capsys):
    bench, sc = _mod("bench_generate"), _mod("step_costs")
    argv = ["--tiny", "--formats", "bf16,c4r4", "--batches", "1,3", "--contexts", "40,200", "--prefill-contexts",
            "160,200", "--prefill-chunk", "64", "--out", str(tmp_path), "--tag", "t"]  # fmt: skip
    assert bench.main(argv) == 0
    out = tmp_path / "costs.json"
    assert sc.main([str(tmp_path / "generate_t.json"), "--model", "tiny", "--formats", "bf16,c4r4",
                    "--out", str(out)]) == 0  # fmt: skip
    costs = StepCosts.from_json(out)
    assert set(costs.decode_ctx_token_s) == {"bf16", "c4r4"}
    d = json.loads(out.read_text())
    n_rows = {f: len(d["fit"][f]["rows"]) for f in ("bf16", "c4r4")}
    assert n_rows == {"bf16": 4 + 3 + 4, "c4r4": 4 + 3 + 4}  # 4 decode shapes, 160 and 200 in chunks of 64
    assert job_time([(64, 64 * 65 // 2, 0, 0), (3, 0, 3, 600)], costs, "c4r4", 3)[0] > 0
