"""What 8-bit tensor-core operands would cost end to end: SmolLM2-MLA evaluated with the attention's query and
probabilities rounded as an FP8 (e4m3) or int8 decode kernel would round them (CPU, issue 9).

Past 32 query heads FlashMLA's BF16 decode is compute-bound (docs/kernels.md, "Many heads"), so a packed kernel can
beat it by 2x only with 8-bit tensor-core products, which the issue allows only if end-to-end accuracy is unchanged
within noise. This measures that before any kernel is written: the converted model (variant a) with the shipped
paper-budget QuantMLA C4R4 transforms through a C4R4 cache (and the base model through a BF16 cache, to see the
rounding alone), every attention call run by the fp32 reference inside
:func:`quantmla.kernels.operand_rounding.simulated_operand_rounding` (schemes: ``fp32``; ``bf16``: today's 16-bit
operands; ``e4m3-q``: FP8 score product; ``int8-q``: int8 score product; ``e4m3``: both products FP8; ``int8-p``:
an int8 output product). Per row:
perplexity, KL(P_fp || P_model) in 1e-3 nats per token and top-1 agreement with the full-precision model (the same
``perplexity`` / ``reference_logprobs`` calls as ``full_budget.py``), and the relative L2 error of the attention
outputs against the same call's exact fp32 result (median / max over calls).

    python benchmarks/operand_accuracy.py      # 4096 tokens per corpus in windows of 1024, ~25 min on 2 cores

Writes ``benchmarks/results/operand_accuracy_<tag>.{json,md}`` (temp file + rename) after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import commit_id  # noqa: E402 - the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
from error_split import add_scoring_args, device_label, score, scoring_setup  # noqa: E402 - error_split's scoring, same data
from results_io import add_output_args, result_stem, write_results  # noqa: E402

CACHES = {"c4r4": "QuantMLA (shipped C4R4 transforms), C4R4 cache", "bf16": "base model, BF16 cache"}
SCHEME_NAMES = {"fp32": "fp32 (reference)", "bf16": "BF16 q, p (today's kernels)", "e4m3-q": "FP8 q, BF16 p",
                "int8-q": "int8 q, BF16 p", "e4m3": "FP8 q, FP8 p", "int8x2-q": "two-term int8 q, BF16 p",
                "int8-p": "BF16 q, int8 p (one scale per 64-key tile)"}  # fmt: skip


def main(argv=None) -> int:
    from quantmla.kernels.operand_rounding import SCHEMES, simulated_operand_rounding

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scoring_args(ap)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"subset of: {', '.join(SCHEMES)}")
    ap.add_argument("--caches", default="c4r4,bf16", help="c4r4 (QuantMLA transforms) and/or bf16 (base model)")
    add_output_args(ap, tag="smollm2")
    args = ap.parse_args(argv)
    args.command = " ".join(["python benchmarks/operand_accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if any(s not in SCHEMES for s in schemes) or any(c not in CACHES for c in caches) or args.tokens % args.context:
        ap.error(f"--schemes from {SCHEMES}, --caches from {tuple(CACHES)}, --tokens a multiple of --context")
    if args.device != "cpu":
        ap.error("--device: the operand rounding is simulated in the torch reference attention, which runs on the "
                 "CPU only; leave --device out")
    stem = result_stem(args.out, "operand_accuracy", args.tag, args.force)
    t0 = time.time()
    base, corpora, data, quantmla, transforms = scoring_setup(args)
    models = {"c4r4": quantmla, "bf16": base}
    res = {"rows": [], "corpora": corpora, "tokens": args.tokens, "context": args.context, "transforms": transforms}
    for cache in caches:
        for scheme in schemes:
            t = time.time()
            with simulated_operand_rounding(scheme, measure=True) as st:
                r = score(models[cache], data, cache, 4, 128, args.context)
            row = {"cache": cache, "scheme": scheme, **r, "attention_rel_l2": st.summary(),
                   "seconds": round(time.time() - t, 1)}  # fmt: skip
            res["rows"].append(row)
            print(json.dumps({**row, "elapsed_s": round(time.time() - t0)}), flush=True)
            write(res, stem, args)
    print(f"done in {time.time() - t0:.0f} s: {stem}.md")
    return 0


def write(res: dict, stem: str, args) -> None:
    commit = res.setdefault("commit", commit_id())  # the commit the run started from, not one made meanwhile
    device = device_label()  # the CPU: the rounding is simulated in the torch reference (main refuses a GPU)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res.update(date=date, commit=commit, device=device, command=args.command)
    cs = res["corpora"]
    L = [f"# 8-bit tensor-core operands, simulated: SmolLM2-MLA variant a ({date}, commit {commit})", "",
         f"Device: {device}. Command: `{args.command}`. Every attention call by the fp32 reference with its query "
         "and probabilities rounded as the scheme says (`quantmla.kernels.operand_rounding`); perplexity / KL(P_fp "
         f"|| P_model) in 1e-3 nats per token / top-1 agreement with the full-precision model on {res['tokens']} test "
         f"tokens per corpus in windows of {res['context']}, sink 4 / local 128. Attention rel. L2: the rounded "
         "output's error against the same call's exact fp32 output (median / max over calls). C4R4 rows: "
         f"`{res['transforms']['file']}` ({res['transforms']['label']}).",
         "",
         "| cache | operands | " + " | ".join(f"{c} ppl | {c} KL | {c} top-1" for c in cs)
         + " | attention rel. L2 median / max |",
         "|---|---|" + "---|---|---|" * len(cs) + "---|"]  # fmt: skip
    for r in res["rows"]:
        cells = " | ".join(f"{r[c]['ppl']:.3f} | {1e3 * r[c]['kl']:.3f} | {r[c]['top1']:.4f}" for c in cs)
        e = r["attention_rel_l2"]
        err = f"{e['median']:.1e} / {e['max']:.1e}" if e.get("calls") else "0"
        L.append(f"| {r['cache'].upper()} | {SCHEME_NAMES[r['scheme']]} | {cells} | {err} |")
    L.append("")
    for cache in {r["cache"] for r in res["rows"]}:
        rows = {r["scheme"]: r for r in res["rows"] if r["cache"] == cache}
        if "bf16" not in rows:
            continue
        for s in SCHEME_NAMES:
            if s in ("fp32", "bf16"):
                continue
            if s in rows:
                d = ", ".join(f"{c} {1e3 * (rows[s][c]['kl'] - rows['bf16'][c]['kl']):+.3f}" for c in cs)
                L.append(f"- {cache.upper()}, {SCHEME_NAMES[s]}: KL vs today's BF16 operands {d} (1e-3 nats/token)")
    write_results(stem, {".json": json.dumps(res, indent=1), ".md": "\n".join(L) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
