"""Issue 10, item 5: is `quantmla eval` with a quantized cache on the GPU no more than 1.5x slower than with BF16,
per sample? Runs the evaluation harness (`quantmla.eval.harness.evaluate`, what `quantmla eval` runs) once per
format on the same model, needle samples and perplexity windows, after one untimed warm-up pass per format (kernel
builds and Triton compiles are not per-sample costs), and reports seconds per retrieval sample and per perplexity
window for each format and their ratio to BF16. The accuracy numbers come along (a fast wrong cache is no answer).

    python benchmarks/eval_speed.py --device cuda --out benchmarks/results --tag h200      # SmolLM2-MLA (bf16)
    python benchmarks/eval_speed.py --smoke                                                # CPU, seconds

Writes eval_speed_<tag>.{json,md} (refuses to overwrite without --force).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import commit_id  # noqa: E402 - the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
from results_io import gpu_tag, result_stem, write_results  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def run(model, tok, fmt: str, args, lengths, samples: int, ppl_tokens: int) -> dict:
    from quantmla.eval.harness import EvalConfig, evaluate

    cfg = EvalConfig(tasks=args.tasks, formats=(fmt,), lengths=lengths, n_per_depth=samples, depths=(0.5,),
                     ppl_tokens=ppl_tokens, ppl_context=args.ppl_context, sink=args.sink, local=args.local)  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = evaluate(model, tok, cfg, model_name=args.model, progress=False)["results"][fmt]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    res["wall_s"] = time.perf_counter() - t0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-mla")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU (default)")
    ap.add_argument("--formats", default="bf16,c8r8,c4r4,c2r4")
    ap.add_argument("--tasks", default="ppl,niah_single_1,passkey")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--samples", type=int, default=3, help="needle samples per (task, length)")
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--local", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="tiny settings on the CPU (checks the script runs)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="default: the GPU model that runs (h100, h200), smoke with --smoke")
    ap.add_argument("--force", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed runs, a slice per format under torch.profiler (one sample per task at the longest "
        "needle length, one perplexity window): the operators and kernels with the most time -> "
        "<stem>_profile.txt, rewritten after every format (where a quantized format's extra time goes)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.device, args.formats, args.lengths, args.samples = "cpu", "bf16,c4r4", "256", 1
        args.ppl_tokens, args.ppl_context, args.tasks = 256, 128, "ppl,passkey"
    tag = args.tag or ("smoke" if args.smoke else gpu_tag())
    stem = result_stem(args.out, "eval_speed", tag, args.force)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is available")
    from quantmla.models.names import resolve_model

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model, tok, _ = resolve_model(args.model, dtype)
    model = model.to(args.device)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    rows = []
    for fmt in args.formats.split(","):
        run(model, tok, fmt, args, lengths[:1], 1, min(args.ppl_tokens, 2 * args.ppl_context))  # warm-up, untimed
        r = run(model, tok, fmt, args, lengths, args.samples, args.ppl_tokens)
        n_samples = len(r.get("samples", []))
        n_windows = r["ppl"]["windows"] if "ppl" in r and "windows" in r["ppl"] else None
        acc = sum(s["correct"] for s in r["samples"]) / n_samples if n_samples else None
        ppl = r["ppl"]["perplexity"] if "ppl" in r else None
        row = {"format": fmt, "wall_s": round(r["wall_s"], 3), "samples": n_samples, "ppl_windows": n_windows,
               "ppl": ppl and round(ppl, 4), "retrieval": acc}  # fmt: skip
        row["s_per_unit"] = round(r["wall_s"] / max(1, n_samples + (n_windows or 0)), 4)
        rows.append(row)
        log(f"{fmt:6s} {row['wall_s']:8.2f} s for {n_samples} samples + {n_windows} windows "
            f"({row['s_per_unit']:.3f} s each) ppl={row['ppl']} retrieval={row['retrieval']}")  # fmt: skip
    base = next((r for r in rows if r["format"] == "bf16"), None)
    for r in rows:
        r["x_bf16"] = round(r["s_per_unit"] / base["s_per_unit"], 3) if base else None
    meta = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"), "commit": commit_id(),
            "command": " ".join(sys.argv), "model": args.model, "dtype": dtype, "tasks": args.tasks,
            "lengths": lengths, "samples_per_cell": args.samples, "ppl_tokens": args.ppl_tokens,
            "ppl_context": args.ppl_context, "target": "quantized <= 1.5x BF16 per sample"}  # fmt: skip
    lines = [f"# quantmla eval speed per sample, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`: {args.model} ({dtype}), tasks {args.tasks}, needle lengths {args.lengths} "
             f"({args.samples} per task and length), perplexity {args.ppl_tokens} tokens in windows of "
             f"{args.ppl_context}; one untimed warm-up per format. Target: quantized <= 1.5x BF16.", "",
             "| format | seconds | samples + windows | s each | x BF16 | perplexity | retrieval |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['format']} | {r['wall_s']:.2f} | {r['samples']} + {r['ppl_windows']} "
                     f"| {r['s_per_unit']:.3f} | {r['x_bf16']} | {r['ppl']} | {r['retrieval']} |")  # fmt: skip
    write_results(stem, {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"})
    if args.profile:
        write_profile(stem, model, tok, args, lengths)
    print(json.dumps({r["format"]: r["x_bf16"] for r in rows}))
    return 0


def write_profile(stem: str, model, tok, args, lengths) -> None:
    """A slice of the run per format under torch.profiler (CPU + CUDA): one sample per task at the longest needle
    length and one perplexity window (the whole run under the profiler took > 3 min per format on the H200,
    2026-12-01), its operator table sorted by self device time (CUDA) or self CPU time, so the formats' extra
    costs can be read side by side -> ``<stem>_profile.txt``, rewritten after each format: a timeout keeps what
    was done."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    parts = []
    for fmt in args.formats.split(","):
        with profile(activities=acts) as prof:
            r = run(model, tok, fmt, args, lengths[-1:], 1, args.ppl_context)
        parts.append(f"===== {fmt}: {r['wall_s']:.2f} s under the profiler (one sample per task at "
                     f"{lengths[-1]} tokens, one perplexity window)\n"
                     + prof.key_averages().table(sort_by=key, row_limit=25))  # fmt: skip
        log(f"profiled {fmt}")
        write_results(stem, {"_profile.txt": "\n\n".join(parts) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
