"""Measured per-step costs for issue 11's Table 10 throughput model (:class:`quantmla.serve.throughput.StepCosts`),
fitted to what ``benchmarks/bench_generate.py`` measured on the DeepSeek-V2-Lite-shaped model.

The model prices a serving step as ``a + b tokens + p prefill_pairs + c decode_ctx_tokens`` (the same pair count
as the trace of ``benchmarks/serve_table10.py``: a query at position ``s`` attends to ``s + 1`` tokens). Each
measured row is one such step, so per cache format the four costs are fitted to:

* decode rows (``batch`` B sequences of ``context`` L cached tokens, median time per step t):
  ``t = a + b B + c B (L + 1)``;
* prefill rows (batch 1): each timed forward of n prompt tokens after s cached ones (``--prefill-chunk``: every
  chunk of the prompt; else the whole prompt at s = 0): ``t = a + b n + p (n s + n (n + 1) / 2)``;

by nonnegative least squares on the relative error (every row weighs the same). Decode rows above
``--max-decode-batch`` (default 8: Table 10 decodes at most 5 requests at once) are reported but not fitted: a
MoE layer reads more experts as the batch grows, which a linear cost per token does not describe. The output is a
StepCosts JSON (``format_overrides`` carries each format's own a, b, p; the shared fields are the BF16 fit) plus
``fit``: every row with its prediction and relative error, so the fit's quality is visible next to its use.

    python benchmarks/step_costs.py RES/generate_h200_v2lite_32k.json RES/generate_h200_v2lite_128k.json \\
        --out benchmarks/results/step_costs_h200_v2lite.json
    .venv-vllm/bin/python benchmarks/serve_table10.py --costs benchmarks/results/step_costs_h200_v2lite.json --force
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from quantmla.serve.throughput import StepCosts  # noqa: E402

TERMS = ("step_overhead_s", "per_token_s", "prefill_pair_s", "decode_ctx_token_s")
FORMATS = "bf16,c8r8,c4r4,c2r4"  # the caches serve_table10 prices (hf is not a serving format)


def step_rows(rows: list[dict], model: str, fmt: str, max_batch: int) -> list[dict]:
    """One entry per measured step of ``fmt``: its (tokens, prefill pairs, decode context tokens), its time, and
    whether the fit uses it."""
    out = []
    for r in rows:
        if r.get("model") != model or r.get("format") != fmt:
            continue
        if r["kind"] == "decode" and "tpot_ms" in r:
            b, n = r["batch"], r["context"]
            out.append({"what": f"decode B{b} x {n}", "x": (1, b, 0, b * (n + 1)), "seconds": r["tpot_ms"] / 1e3,
                        "used": b <= max_batch})  # fmt: skip
        elif r["kind"] == "prefill" and "seconds" in r:
            n, chunk = r["context"], r.get("chunk") or r["context"]
            times = r.get("chunk_seconds") or [r["seconds"]]
            for i, t in enumerate(times):
                s = i * chunk
                k = min(chunk, n - s)
                out.append({"what": f"prefill {k} after {s}", "x": (1, k, k * s + k * (k + 1) // 2, 0),
                            "seconds": t, "used": True})  # fmt: skip
    return out


def nnls_relative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin ||(x w - t) / t|| over w >= 0, exactly: the best least-squares solution over every set of free terms
    (four terms: 15 sets) that comes out nonnegative."""
    a, y = x / t[:, None], np.ones_like(t)
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            w, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (w < 0).any():
                continue
            full = np.zeros(x.shape[1])
            full[list(cols)] = w
            err = float(np.sum((a @ full - y) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def fit_format(steps: list[dict], fmt: str) -> dict[str, float]:
    used = [s for s in steps if s["used"]]
    x = np.array([s["x"] for s in used], dtype=np.float64).reshape(-1, len(TERMS))
    t = np.array([s["seconds"] for s in used], dtype=np.float64)
    if len(used) < len(TERMS) or np.linalg.matrix_rank(x / t[:, None]) < len(TERMS):
        kinds = sorted({s["what"].split()[0] for s in used})
        raise SystemExit(f"error: {fmt}: {len(used)} usable rows ({', '.join(kinds) or 'none'}) cannot determine "
                         "the four costs: it needs decode rows at two batch sizes or contexts and prefill rows at "
                         "two lengths or chunk positions (bench_generate --contexts, --batches, --prefill-contexts, "
                         "--prefill-chunk)")  # fmt: skip
    w = nnls_relative(x, t)
    for s in steps:
        s["predicted"] = float(np.dot(s["x"], w))
        s["rel_err"] = s["predicted"] / s["seconds"] - 1
    return dict(zip(TERMS, map(float, w)))


def build(paths: list[str], model: str, formats: list[str], max_batch: int) -> dict:
    rows, metas, desc = [], [], f"{model} (no description)"
    for p in paths:
        d = json.loads(Path(p).read_text())
        if "rows" not in d or "meta" not in d:
            raise SystemExit(f"error: {p} is not a bench_generate results file (no 'meta'/'rows')")
        rows += d["rows"]
        metas.append(d["meta"])
        desc = next((f"{model} ({m['description']}, {m['dtype']})" for m in d.get("models", [])
                     if m.get("model") == model and m.get("params")), desc)  # fmt: skip
    fits, per = {}, {}
    for f in formats:
        steps = step_rows(rows, model, f, max_batch)
        per[f] = fit_format(steps, f)
        fits[f] = {"rows": [{k: v for k, v in s.items() if k != "x"} for s in steps],
                   "max_abs_rel_err_fitted": max(abs(s["rel_err"]) for s in steps if s["used"])}  # fmt: skip
    ref = per["bf16"] if "bf16" in per else per[formats[0]]
    worst = max(v["max_abs_rel_err_fitted"] for v in fits.values())
    where = "; ".join(sorted({f"{m['device']} {m['date']} commit {m['commit']}" for m in metas}))
    partial = [m["partial"] for m in metas if m.get("partial")]
    costs = StepCosts(
        label=f"measured: bench_generate on {where}, {desc}, fitted per format",
        assumptions=f"Per-step costs of our transformers generate loop (transformers' DeepseekV2 modules, absorbed "
        f"attention over QuantMLACache, our kernels; not vLLM's fused kernels), fitted per format as t = a + b "
        f"tokens + p prefill pairs + c decode context tokens to decode rows at batch <= {max_batch} and chunked "
        f"prefill rows; largest relative error of a fitted row {100 * worst:.1f}%. BF16 = our BF16 pages and kernels "
        f"(a stand-in for vLLM's own BF16 MLA backend). Sources: {', '.join(os.path.basename(p) for p in paths)}"
        + (f"; PARTIAL runs: {'; '.join(partial)}" if partial else "") + ".",
        step_overhead_s=ref["step_overhead_s"], per_token_s=ref["per_token_s"], prefill_pair_s=ref["prefill_pair_s"],
        decode_ctx_token_s={f: c["decode_ctx_token_s"] for f, c in per.items()},
        format_overrides={f: {k: c[k] for k in TERMS[:3]} for f, c in per.items()},
    )  # fmt: skip
    return {**costs.to_dict(), "fit": fits, "model": model, "sources": [str(p) for p in paths]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_generate JSON files (generate_<tag>.json)")
    ap.add_argument("--out", required=True, help="the StepCosts JSON to write")
    ap.add_argument("--model", default="v2-lite", help="which model's rows (default v2-lite)")
    ap.add_argument("--formats", default=FORMATS, help=f"cache formats to fit (default {FORMATS})")
    ap.add_argument("--max-decode-batch", type=int, default=8, help="decode rows above this batch are not fitted")
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not args.force:
        raise SystemExit(f"error: {args.out} exists; pass --force to replace it")
    for p in args.results:
        if not os.path.isfile(p):
            raise SystemExit(f"error: {p}: no such results file (run benchmarks/bench_generate.py first)")
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    d = build(args.results, args.model, formats, args.max_decode_batch)
    tmp = args.out + ".tmp"
    Path(tmp).write_text(json.dumps(d, indent=1) + "\n")
    StepCosts.from_json(tmp)  # what serve_table10 --costs reads
    os.replace(tmp, args.out)
    for f in formats:
        c = {k: d["format_overrides"][f][k] for k in TERMS[:3]}
        print(f"{f}: overhead {1e3 * c['step_overhead_s']:.3f} ms, per token {1e6 * c['per_token_s']:.3f} us, "
              f"per prefill pair {1e12 * c['prefill_pair_s']:.3f} ps, per decode context token "
              f"{1e12 * d['decode_ctx_token_s'][f]:.3f} ps; worst fitted row "
              f"{100 * d['fit'][f]['max_abs_rel_err_fitted']:.1f}%")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
