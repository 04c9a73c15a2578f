"""The report of ``benchmarks/bench_generate.py``: ``generate_<tag>.json`` (meta, models, every row), a markdown
file (the checks, decode time per output token per format and shape -- eager, and captured in a CUDA graph where
``--graph`` measured it -- prompt ingestion, the largest batch a cache budget holds) and a plot of time per output
token over context; each file through a temp file and a rename."""

from __future__ import annotations

import json
import os
import sys


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def write_outputs(out_dir: str, tag: str, meta: dict, models: list[dict], rows: list[dict]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"generate_{tag}")
    paths = [base + ".json", base + ".md"]
    with open(paths[0] + ".tmp", "w") as f:
        json.dump({"meta": meta, "models": models, "rows": rows}, f, indent=1)
    os.replace(paths[0] + ".tmp", paths[0])
    with open(paths[1] + ".tmp", "w") as f:
        f.write(markdown(meta, models, rows))
    os.replace(paths[1] + ".tmp", paths[1])
    try:
        paths.append(plot(base + ".png", rows))
    except ImportError:
        log("matplotlib missing: no plot")
    return paths


def markdown(meta: dict, models: list[dict], rows: list[dict]) -> str:
    L = [f"# Generation through QuantMLACache, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
         f"Command: `{meta['command']}`", "", "Sink 4 / local 128 / page 64; absorbed attention over the cache, "
         "`decode_attention(impl=\"auto\")`; `hf` = transformers' DynamicCache with the model's own attention.", ""]
    if meta.get("partial"):
        L += [f"**Partial run: {meta['partial']}; the rows below are what was measured before.**", ""]
    for m in models:
        name = m["model"]
        mine = [r for r in rows if r["model"] == name]
        fmts = list(dict.fromkeys(r["format"] for r in mine if r["kind"] == "decode"))
        L += [f"## {name}: {m['description']} ({m['params'] / 1e9:.2f}B parameters, {m['dtype']})", ""]
        L += ["Check against the fp32 torch references (logits, relative L2 / top-1):", ""]
        for r in (r for r in mine if r["kind"] == "check"):
            L.append(f"- {r['format']}: prefill {r['prefill_rel_l2']:.2e} / {r['prefill_top1']:.3f}, decode "
                     f"{r['decode_rel_l2']:.2e} / {r['decode_top1']:.3f}{'' if r['ok'] else '  **FAILED: not timed**'}")
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in mine if r["kind"] == "decode"))
        L += ["", "Decode, time per output token in ms (tokens/s), ratio to `bf16`:", ""]
        L += _tpot_table(mine, fmts, shapes, "")
        captured = [f for f in fmts if any("graph_tpot_ms" in r for r in mine if r["format"] == f)]
        if captured:  # --graph
            L += ["", "Decode with the step captured in a CUDA graph and replayed (`--graph`, `quantmla.cache.graph`), "
                  "same caches after the eager steps: time per output token in ms (tokens/s), ratio to `bf16`:", ""]
            L += _tpot_table(mine, captured, shapes, "graph_")
        refused = sorted({r["graph_skipped"] for r in mine if "graph_skipped" in r})
        if refused:  # --graph on a model or cache the capture refuses
            L += ["", "Not captured in a CUDA graph: " + "; ".join(refused)]
        pre = [r for r in mine if r["kind"] == "prefill" and "seconds" in r]
        if pre:
            how = f"forwards of {pre[0]['chunk']} tokens" if pre[0].get("chunk") else "one forward"
            L += ["", f"Prompt ingestion (batch 1, {how} into a fresh cache):", "",
                  "| context | format | seconds | prompt tokens/s |", "|---|---|---|---|"]
            L += [f"| {r['context']} | {r['format']} | {r['seconds']:.3f} | {r['prompt_tok_s']:.0f} |" for r in pre]
        bud = [r for r in mine if r["kind"] == "budget"]
        if bud:
            ref = next((r["max_batch"] for r in bud if r["format"] == "bf16"), None)
            L += ["", f"Largest batch whose cache fits {bud[0]['budget_bytes'] / 2**30:.3g} GiB at "
                  f"{bud[0]['context']} tokens:", "", "| format | bytes / sequence | max batch | vs bf16 | confirmed |",
                  "|---|---|---|---|---|"]
            for r in bud:
                vs = f"{r['max_batch'] / ref:.2f}x" if ref else "-"
                L.append(f"| {r['format']} | {r['per_sequence_bytes']:,} | {r['max_batch']} | {vs} | "
                         f"{r.get('fits', 'not allocated')} |")
        L.append("")
    return "\n".join(L) + "\n"


def _tpot_table(mine: list[dict], fmts: list[str], shapes: list[tuple], key: str) -> list[str]:
    """Rows ``batch x context`` by format of ``<key>tpot_ms`` (``<key>tok_s``, ratio to bf16); ``key`` "" for the
    eager steps, "graph_" for the captured ones."""
    L = ["| batch | context | " + " | ".join(fmts) + " |", "|---|---|" + "---|" * len(fmts)]
    for b, n in shapes:
        cell = {r["format"]: r for r in mine if r["kind"] == "decode" and (r["batch"], r["context"]) == (b, n)}
        ref = cell.get("bf16", {}).get(key + "tpot_ms")
        out = []
        for f in fmts:
            r = cell.get(f, {})
            if key + "tpot_ms" not in r:
                out.append("does not fit" if "skipped" in r else "-")
                continue
            ratio = f", {r[key + 'tpot_ms'] / ref:.2f}x" if ref and f != "bf16" else ""
            out.append(f"{r[key + 'tpot_ms']:.2f} ({r[key + 'tok_s']:.0f}/s{ratio})")
        L.append(f"| {b} | {n} | " + " | ".join(out) + " |")
    return L


def plot(path: str, rows: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in rows if r["kind"] == "decode" and "tpot_ms" in r]
    keys = list(dict.fromkeys((r["model"], r["batch"]) for r in dec))
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.5 * max(1, len(keys)), 3.6), squeeze=False)
    for ax, (m, b) in zip(axes[0], keys):
        for f in dict.fromkeys(r["format"] for r in dec):
            pts = sorted((r["context"], r["tpot_ms"]) for r in dec
                         if (r["model"], r["batch"], r["format"]) == (m, b, f))  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f)
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="ms per output token", title=f"{m}, batch {b}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
