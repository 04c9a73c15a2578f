"""QuantMLA vs RTN / SmoothQuant-MLA / QuaRot-MLA on the converted SmolLM2-MLA model, C4R4 and C2R4, plus the
component ablation (paper Tables 1 and 3), on a CPU.

For each (format, method): copy the model, calibrate it (``quantmla.calibrate``, preset ``cpu-fast`` unless
overridden) with the serving policy, then evaluate the fused model through the quantized cache: perplexity on
the held-out Shakespeare test split and needle retrieval where the full-precision model scores well (S-NIAH-1,
S-NIAH-2 and passkey at 512 tokens). Writes ``benchmarks/results/quantmla_smollm2.{json,md}``.

    python benchmarks/quantmla_results.py                 # ~35 min on 2 CPU cores
    python benchmarks/quantmla_results.py --quick         # smaller budget, for a smoke run
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _rows_plan(formats):
    # (label, format, method, config overrides, cache sink/local)
    plan = [("BF16", "bf16", None, {}, (4, 128))]
    for f in formats:
        plan += [
            (f"{f.upper()} RTN", f, "rtn", {}, (4, 128)),
            (f"{f.upper()} SmoothQuant-MLA", f, "smoothquant", {}, (4, 128)),
            (f"{f.upper()} QuaRot-MLA", f, "quarot", {}, (4, 128)),
            (f"{f.upper()} QuantMLA", f, "quantmla", {}, (4, 128)),
        ]
    return plan


ABLATION = [
    ("RTN, no protection (sink 0, local 0)", "rtn", {"sink": 0, "local": 0}, (0, 0)),
    ("+ sink/local protection (4/128)", "rtn", {}, (4, 128)),
    ("+ RoPE transform (positional QK objective)", "quantmla", {"content_init": "identity", "steps_content": 0},
     (4, 128)),
    ("+ content transform (attention-output objective) = QuantMLA", "quantmla", {}, (4, 128)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="c4r4,c2r4")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-context", type=int, default=512)
    ap.add_argument("--samples", type=int, default=2, help="needle samples per depth (depths 0.1, 0.5, 0.9)")
    ap.add_argument("--lengths", default="512")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,passkey")
    ap.add_argument("--preset", default="cpu-fast")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--tag", default="smollm2")
    ap.add_argument("--methods", default="rtn,smoothquant,quarot,quantmla", help="which methods' rows to run")
    ap.add_argument("--override", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="CalibrationConfig fields over the preset, e.g. steps_content=100 train_seqs=16")
    args = ap.parse_args()
    args.command = "python benchmarks/quantmla_results.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(args.threads)
    if args.quick:
        args.ppl_tokens, args.samples = 2048, 1

    from quantmla.calibrate.config import CalibrationConfig
    from quantmla.calibrate.trainer import calibrate_model
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity, reference_logprobs
    from quantmla.eval.retrieval import run_retrieval
    from quantmla.eval.runtime import CacheSpec
    from quantmla.models.convert import converted_model_dir, load_model

    path = converted_model_dir()
    base, tok = load_model(path)
    ppl_ids = token_stream(tok, split="test", n_tokens=args.ppl_tokens)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    reference = reference_logprobs(base, ppl_ids, context=args.ppl_context)  # full-precision next-token laws

    def evaluate(model, fmt, sink, local):
        cache = CacheSpec(fmt, sink, local)
        t0 = time.time()
        pr = perplexity(model, ppl_ids, context=args.ppl_context, cache=cache, reference=reference)
        ret = {}
        if args.tasks != "none":
            summary, _ = run_retrieval(model, tok, tasks=tuple(args.tasks.split(",")), lengths=lengths,
                                       depths=(0.1, 0.5, 0.9), n_per_depth=args.samples, cache=cache, seed=0)
            ret = {f"{t}@{n}": (v["correct"], v["n"]) for t, by in summary.items() for n, v in by.items()}
        return {"ppl": pr.perplexity, "kl": pr.kl_to_reference, "retrieval": ret, "eval_s": time.time() - t0}

    def calibrated(fmt, method, overrides):
        cfg = CalibrationConfig.preset(args.preset, method=method, device="cpu", progress=False,
                                       **{**extra, **overrides})
        n = cfg.train_seqs + cfg.val_seqs
        calib = token_stream(tok, split="calibration", n_tokens=n * cfg.seq_len).view(n, cfg.seq_len)
        model = copy.deepcopy(base)
        t0 = time.time()
        rep = calibrate_model(model, fmt, calib, cfg)
        return model, {"calib_s": time.time() - t0, "config": cfg.to_dict(), "summary": rep.summary()}

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    extra = {}
    for item in args.override:
        key, _, value = item.partition("=")
        extra[key] = type(getattr(CalibrationConfig(), key))(value)  # int / float / str like the field
    rows, ablation = [], []
    methods = set(args.methods.split(","))
    for label, fmt, method, ov, (sink, local) in _rows_plan(formats):
        if method is not None and method not in methods:
            continue
        model, info = (base, {}) if method is None else calibrated(fmt, method, {"sink": sink, "local": local, **ov})
        res = {"label": label, "format": fmt, "method": method, **evaluate(model, fmt, sink, local), **info}
        rows.append(res)
        print(json.dumps({k: res[k] for k in ("label", "ppl", "retrieval")}), flush=True)
        write(rows, ablation, args, quiet=True)  # partial results survive an interrupted run
        if fmt == "c4r4" and method == "quantmla":
            ablation_full = res
        if fmt == "c4r4" and method == "rtn":
            ablation_rtn = res
    if not args.no_ablation and "c4r4" in formats:
        for label, method, ov, (sink, local) in ABLATION:
            if method == "rtn" and (sink, local) == (4, 128):
                res = dict(ablation_rtn)
            elif method == "quantmla" and not ov:
                res = dict(ablation_full)
            else:
                model, info = calibrated("c4r4", method, {"sink": sink, "local": local, **ov})
                res = {**evaluate(model, "c4r4", sink, local), **info}
            res["label"] = label
            ablation.append(res)
            print(json.dumps({k: res[k] for k in ("label", "ppl", "retrieval")}), flush=True)
            write(rows, ablation, args, quiet=True)
    write(rows, ablation, args)


def _overrides(args) -> str:
    return " with " + " ".join(args.override) if getattr(args, "override", None) else ""


def write(rows, ablation, args, quiet: bool = False, stamp: tuple[str, str] | None = None) -> None:
    """Write JSON + markdown; ``stamp`` = (date, commit) of the run when re-rendering an earlier result."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if stamp:
        date, commit = stamp
    meta = {"date": date, "commit": commit,
            "device": f"CPU ({platform.processor() or platform.machine()}, {args.threads} threads)",
            "torch": torch.__version__, "args": vars(args)}
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"quantmla_{args.tag}")
    with open(stem + ".json.tmp", "w") as f:
        json.dump({**meta, "rows": rows, "ablation": ablation}, f, indent=2, default=str)
    os.replace(stem + ".json.tmp", stem + ".json")
    keys = sorted({k for r in rows + ablation for k in r.get("retrieval", {})})
    bf16 = rows[0]["ppl"]

    def line(r):
        cells = [f"{r['retrieval'][k][0]}/{r['retrieval'][k][1]}" if k in r.get("retrieval", {}) else "-" for k in keys]
        kl = f"{max(1e3 * r['kl'], 0.0):.3f}" if r.get("kl") is not None else "-"  # -1e-9 rounding shows as 0
        return f"| {r['label']} | {r['ppl']:.3f} | {100 * (r['ppl'] / bf16 - 1):+.2f}% | {kl} |" + "".join(
            f" {c} |" for c in cells)

    head = "| configuration | ppl | vs BF16 | KL to full precision (1e-3 nats/token) |"
    head += "".join(f" {k} |" for k in keys) + "\n|---|---|---|---|" + "---|" * len(keys)
    retrieval = "not run." if args.tasks == "none" else (
        f"exact-match correct / samples at {args.lengths} tokens (depths 0.1/0.5/0.9 x {args.samples}).")
    command = getattr(args, "command", "python benchmarks/quantmla_results.py")
    md = [f"# QuantMLA vs baselines, converted SmolLM2-135M-MLA ({meta['date']}, commit {commit}, {meta['device']})",
          "",
          f"Perplexity: {args.ppl_tokens} tokens of the Shakespeare test split, context {args.ppl_context}. "
          f"Retrieval: {retrieval} Calibration preset `{args.preset}`{_overrides(args)}; cache policy sink 4 / "
          f"local 128 unless stated. Command: `{command}`.", "", "## Methods", "", head]
    md += [line(r) for r in rows]
    if ablation:
        md += ["", "## Ablation at C4R4 (components added one at a time)", "", head]
        md += [line(r) for r in ablation]
    gaps, kls = {}, {}
    for f in {r["format"] for r in rows if r["method"]}:
        by = {r["method"]: r for r in rows if r["format"] == f}
        if "rtn" in by and "quantmla" in by and by["rtn"]["ppl"] > bf16:
            gaps[f] = (by["rtn"]["ppl"] - by["quantmla"]["ppl"]) / (by["rtn"]["ppl"] - bf16)
        if "rtn" in by and "quantmla" in by and by["rtn"].get("kl"):
            kls[f] = 1 - by["quantmla"]["kl"] / by["rtn"]["kl"]
    md += ["", "Share of the RTN-vs-BF16 perplexity gap closed by QuantMLA: "
           + ", ".join(f"{k.upper()} {100 * v:.0f}%" for k, v in sorted(gaps.items())),
           "", "KL to full precision removed by QuantMLA relative to RTN: "
           + ", ".join(f"{k.upper()} {100 * v:.0f}%" for k, v in sorted(kls.items())),
           "", "KL: mean over every position of every window of KL(P_full-precision || P_cache), the model's own "
           "forward without a cache as the reference; the first sink + local positions of a window read no "
           "quantized key and contribute 0."]
    with open(stem + ".md.tmp", "w") as f:
        f.write("\n".join(md) + "\n")
    os.replace(stem + ".md.tmp", stem + ".md")
    if not quiet:
        print("\n".join(md))


if __name__ == "__main__":
    main()
