"""What query-aware RoPE rounding costs the fused writer (GPU): one layer's write of a decode step and of a prefill
chunk, C4R4 / C2R4 at DeepSeek's shapes (latent 512, RoPE 64), with round-to-nearest and with a rounding plan.

    PYTHONPATH=src python benchmarks/bench_writer.py --out benchmarks/results --tag h100

Checks first that the plan's codes are quantize_codes_feedback's (the torch reference) on a slice, then times
``PagedMLACache.write(impl="triton")`` with CUDA events (median of 50 after warm-up), the plan's writes at each
``--feedback-warps`` count (``triton_writer.FEEDBACK_WARPS``: warps per token program), and writes
``writer_rounding_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import commit_id  # noqa: E402
from results_io import add_output_args, gpu_tag, result_stem, write_results  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="c4r4,c2r4")
    ap.add_argument("--shapes", default="32x1,128x1,1x8192,1x32768", help="B x T tokens written per call")
    ap.add_argument("--feedback-warps", default="4,2,1", help="triton_writer.FEEDBACK_WARPS values to time")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the fused Triton writer is timed)")
    stem = result_stem(args.out, "writer_rounding", args.tag or gpu_tag(), args.force)
    from quantmla.kernels import triton_writer
    from quantmla.kernels.paged import PagedMLACache
    from quantmla.quant.rounding import fit_rope_rounding

    warps = [int(w) for w in args.feedback_warps.split(",")]
    default_warps = triton_writer.FEEDBACK_WARPS

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g)
    plan = fit_rope_rounding(a @ a.T)
    rows = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            b, t = (int(x) for x in shape.split("x"))
            c = torch.randn(b, t, 512, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, t, 64, device="cuda", dtype=torch.bfloat16)
            row = {"format": fmt, "batch": b, "tokens": t}
            runs = [("nearest", None, triton_writer.WARPS)] + [(f"query-aware/w{w}", plan, w) for w in warps]
            for name, p, w in runs:
                triton_writer.FEEDBACK_WARPS = w
                cache = PagedMLACache(fmt, b, t, device="cuda")
                cache.set_rope_rounding(p)
                if t <= 64:  # correctness first: the Triton writer's bytes against the torch writer's
                    ref = PagedMLACache(fmt, b, t, device="cuda")
                    ref.set_rope_rounding(p)
                    ref.write(c, k, impl="torch")
                    cache.write(c, k, impl="triton")
                    if not torch.equal(ref.pool, cache.pool):
                        raise SystemExit(f"{fmt} {shape} {name}: Triton writer differs from the torch writer")
                times = []
                for i in range(60):
                    cache.seq_lens.zero_()
                    cache._lens = [0] * b
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    cache.write(c, k, impl="triton")
                    e.record()
                    torch.cuda.synchronize()
                    if i >= 10:
                        times.append(s.elapsed_time(e) * 1e3)
                row[name + "_us"] = statistics.median(times)
            triton_writer.FEEDBACK_WARPS = default_warps
            row["query-aware_us"] = row[f"query-aware/w{default_warps}_us"] if default_warps in warps else None
            row["ratio"] = min(row[f"query-aware/w{w}_us"] for w in warps) / row["nearest_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dev = torch.cuda.get_device_name()
    res = {"rows": rows, "device": dev, "date": date, "commit": commit_id(), "command": " ".join(sys.argv)}
    md = [f"# Fused writer with query-aware RoPE rounding ({dev}, {date}, commit {res['commit']})", "",
          f"Command: `{res['command']}`. One layer's `write(impl=\"triton\")`, CUDA events, median of 50 (host launch "
          "overhead included: this is a write's whole cost as a caller sees it).", "",
          "| format | B x T | round to nearest us | " + " | ".join(f"query-aware, {w} warps us" for w in warps)
          + " | best ratio |", "|---|---|---|" + "---|" * len(warps) + "---|"]  # fmt: skip
    for r in rows:
        md.append(f"| {r['format'].upper()} | {r['batch']} x {r['tokens']} | {r['nearest_us']:.1f} | "
                  + " | ".join(f"{r[f'query-aware/w{w}_us']:.1f}" for w in warps) + f" | {r['ratio']:.2f}x |")
    write_results(stem, {".json": json.dumps(res, indent=1) + "\n", ".md": "\n".join(md) + "\n"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
