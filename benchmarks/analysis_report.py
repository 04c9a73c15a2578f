"""The report of ``benchmarks/analysis_results.py``: the error-model analysis written as JSON, a markdown reading of
it (per model: predicted vs measured sensitivity, interventions, the RoPE/content response ratio against the paper's
Table 4 range) and the error atlas figures; every file through a temp file and a rename."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PAPER_RATIO_RANGE = (1.9, 6.9)  # the paper's Table 4: model-level RoPE/content response ratio across its models
REAL = "smollm2_mla"


def _clean(o):
    """JSON-safe copy: nan/inf -> None, report objects dropped."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items() if not k.startswith("_")}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def intervention_summary(res: dict) -> dict:
    """Per level, path and intervention: mean / min / max over layers of (intervened response / original)."""
    out = {}
    for r in res["error_model"]["layers"]:
        for path, by in r["interventions"].items():
            for kind, v in by.items():
                out.setdefault(f"{r['cache_nmse']:g}", {}).setdefault(path, {}).setdefault(kind, []).append(v)
    return {
        lv: {
            p: {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for k, v in by.items()}
            for p, by in paths.items()
        }
        for lv, paths in out.items()
    }


def _atomic_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write(models: dict, args, levels, command: str, wall: float, quiet: bool = False) -> None:
    from quantmla.analysis.error_model import plot_atlas
    from quantmla.analysis.predictor import PREDICTORS

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "device": f"CPU ({platform.processor() or platform.machine()}, {args.threads} thread"
        f"{'s' if args.threads != 1 else ''})",
        "torch": torch.__version__,
        "command": command,
        "args": vars(args),
        "wall_s": wall,
        "budget": f"whole run under ~15 min on one CPU thread (defaults): real model {args.seqs} x {args.seq_len} "
        f"calibration tokens, {args.query_tokens} sampled query positions per sequence, {args.repeats} draws per "
        "intervention (flags --seqs/--seq-len/--query-tokens/--repeats)",
        "paper_table4_ratio_range": list(PAPER_RATIO_RANGE),
        "note": "tiny_* models are random-init and fed uniform random token ids: they have no trained attention "
        "structure, so their responses and ratios describe the operators' geometry only",
    }
    for m in models.values():
        m["interventions_summary"] = intervention_summary(m)
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, args.tag)
    _atomic_text(stem + ".json", json.dumps(_clean({**meta, "models": models}), indent=1) + "\n")
    atlases = []
    if REAL in models:
        for lv in levels:
            final = os.path.join(RESULTS, f"{args.tag}_atlas_smollm2_nmse{lv:g}.png")
            tmp = final[:-4] + ".tmp.png"
            if plot_atlas(models[REAL]["_report"], tmp, lv) is not None:
                os.replace(tmp, final)
                atlases.append(os.path.basename(final))

    lv_keys = [f"{lv:g}" for lv in levels]
    md = [
        f"# Dual-path error model: measured ({meta['date']}, commit {commit}, {meta['device']}, torch {meta['torch']})",
        "",
        f"Command: `{command}` (wall {wall / 60:.1f} min). Budget: {meta['budget']}.",
        "",
        f"Per attention layer, the `{args.format}` format's real QDQ error of ONE path (content latent `c` or RoPE "
        "key `k_pe`), rescaled to a cache NMSE level, is added to that path only; response = attention-output NMSE "
        "/ cache NMSE (fp32, causal, `o_proj` without bias, sampled query positions). Model level = mean over "
        "layers (ratio of the means, as the paper's Table 4).",
        "",
        f"Models: `{REAL}` = SmolLM2-135M-Instruct converted to MLA (variant a, `quantmla_mla`: latent 256, RoPE "
        "key 128, 9 heads, 30 layers) on Shakespeare calibration text. `tiny_*` = "
        f"`quantmla.mla.tiny` families at {args.tiny_layers} attention modules, random init, fed "
        f"{args.tiny_seqs} x {args.tiny_seq_len} uniform random token ids ({args.tiny_query_tokens} queries). "
        "**Random-init models have no trained attention structure, so their ratios describe the operators' "
        "geometry only**, not what a trained model of that family does. `quantmla.mla.tiny` has no "
        "`quantmla_mla` variant; that family is covered by the real model.",
        "",
    ]

    md += [
        "## Table 4-like: model-level RoPE/content response ratio",
        "",
        f"Paper's Table 4 reference range: RoPE/content = {PAPER_RATIO_RANGE[0]}x - {PAPER_RATIO_RANGE[1]}x "
        "(RoPE path more sensitive) across its models.",
        "",
        "Attention entropy: mean over layers, heads and queries of the entropy relative to uniform over the "
        "visible keys (1 = uniform), first sequence; logit std: std of the content and RoPE logit terms.",
        "",
        "| model | cache NMSE | content response | RoPE response | RoPE/content | median layer ratio | "
        "layers with ratio > 1 | attention entropy | logit std content / RoPE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in models.items():
        for lv in lv_keys:
            ml = m["error_model"]["model_level"][lv]
            rows = [r for r in m["error_model"]["layers"] if f"{r['cache_nmse']:g}" == lv]
            up = sum(r["ratio"] > 1 for r in rows)
            st = m["attention_stats"]
            ent = sum(a["relative_entropy"] for a in st) / len(st)
            lc = sum(a["content_logit_std"] for a in st) / len(st)
            lr = sum(a["rope_logit_std"] for a in st) / len(st)
            md.append(
                f"| {name} | {lv} | {ml['content_response']:.4g} | {ml['rope_response']:.4g} | "
                f"{ml['ratio']:.3g}x | {ml['median_layer_ratio']:.3g}x | {up}/{len(rows)} | {ent:.2f} | "
                f"{lc:.2f} / {lr:.2f} |"
            )

    md += [
        "",
        "## Table 5-like: predictor of layer-wise responses (held-out layers)",
        "",
        "Predictions from operator traces (first-order, diagonal error covariance, heads incoherent); one global "
        "log offset fitted on even-index layers, scored on odd-index layers (all levels, both paths). "
        "`cache_error_only` predicts the same response everywhere (Spearman undefined). log-ratio MAE: mean "
        "|log measured RoPE/content - log predicted| per held-out layer and level. The pooled Spearman mixes both "
        "paths (high as soon as the predictor separates them); the within-path columns rank the held-out layers "
        "of one path, the layer-wise amplification proper.",
        "",
        "| model | predictor | held-out points | Spearman (pooled) | Spearman content layers | Spearman RoPE "
        "layers | median abs log error | log-ratio MAE | log offset |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt=".3f"):
        return "n/a" if v is None or not math.isfinite(v) else format(v, fmt)

    for name, m in models.items():
        for p in PREDICTORS:
            s = m["predictor"]["metrics"][p]
            wp = s["spearman_within_path"]
            md.append(
                f"| {name} | {p} | {s['held_out_points']} | {f(s['spearman'])} | {f(wp['content'])} | "
                f"{f(wp['rope'])} | {f(s['median_abs_log_error'])} | {f(s['log_ratio_mae'])} | {f(s['log_offset'])} |"
            )

    if any(m["interventions_summary"] for m in models.values()):
        kinds = sorted(
            {k for m in models.values() for lv in m["interventions_summary"].values() for by in lv.values() for k in by}
        )
        md += [
            "",
            "## Table 6-like: equal-energy interventions",
            "",
            "Response with the error replaced, at the same energy, by a sign-randomized copy, a whole-token "
            f"permutation, or an isotropic Gaussian direction ({args.repeats} draws each), relative to the "
            "original quantization error's response (1 = no change; < 1: the real error is allocated where the "
            "operator is more sensitive). Mean over layers [min - max].",
            "",
            "| model | cache NMSE | path | " + " | ".join(kinds) + " |",
            "|---|---|---|" + "---|" * len(kinds),
        ]
        for name, m in models.items():
            for lv, paths in m["interventions_summary"].items():
                for path, by in paths.items():
                    cells = [
                        f"{by[k]['mean']:.3f} [{by[k]['min']:.2f} - {by[k]['max']:.2f}]" if k in by else "-"
                        for k in kinds
                    ]
                    md.append(f"| {name} | {lv} | {path} | " + " | ".join(cells) + " |")

    if REAL in models:
        m = models[REAL]
        md += [
            "",
            f"## Per layer, {REAL}",
            "",
            "| layer | "
            + " | ".join(f"content @{lv} | RoPE @{lv} | ratio @{lv}" for lv in lv_keys)
            + " | attention entropy |",
            "|---|" + "---|---|---|" * len(lv_keys) + "---|",
        ]
        ents = {a["layer"]: a["relative_entropy"] for a in m["attention_stats"]}
        by = {(r["layer"], f"{r['cache_nmse']:g}"): r for r in m["error_model"]["layers"]}
        for lay in sorted({r["layer"] for r in m["error_model"]["layers"]}):
            cells = []
            for lv in lv_keys:
                r = by[(lay, lv)]
                cells.append(f"{r['content_response']:.4g} | {r['rope_response']:.4g} | {r['ratio']:.3g}")
            md.append(f"| {lay} | " + " | ".join(cells) + f" | {ents[lay]:.2f} |")
        if atlases:
            md += [
                "",
                "Atlas (Figure 6-like; rows content, RoPE, ratio; log colour): "
                + ", ".join(f"![{a}]({a})" for a in atlases),
            ]

    md += ["", "## Reading", ""] + reading(models, lv_keys)
    md += [
        "",
        "## Checks",
        "",
        "Every response and intervention ratio is positive and finite; every model has one row per attention "
        "layer and requested level; the predictor re-measures the responses in its own pass (same seed, queries "
        "and error) and agrees with the error model (max relative difference "
        + ", ".join(f"{n} {m['checks']['measured_consistency_max_rel_diff']:.1e}" for n, m in models.items())
        + "). The "
        "error model itself is checked against the attention modules' own forward with the error injected "
        "through a cache stub, and the predictor's traces against Monte-Carlo (`tests/analysis`).",
    ]
    _atomic_text(stem + ".md", "\n".join(md) + "\n")
    if not quiet:
        print("\n".join(md))


def f2(v) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}"


def reading(models: dict, lv_keys) -> list[str]:
    out = []
    lo, hi = PAPER_RATIO_RANGE
    if REAL in models:
        m = models[REAL]
        ml = m["error_model"]["model_level"]
        rs = [ml[lv]["ratio"] for lv in lv_keys]
        where = (
            "inside"
            if all(lo <= r <= hi for r in rs)
            else "below"
            if all(r < lo for r in rs)
            else "above"
            if all(r > hi for r in rs)
            else "partly inside"
        )
        out.append(
            f"- **Real model ({REAL})**: model-level RoPE/content ratio "
            + ", ".join(f"{r:.2f}x at {lv}" for r, lv in zip(rs, lv_keys, strict=True))
            + f", {where} the paper's {lo}x-{hi}x range"
            + (
                " -- per unit of cache NMSE the content latent, not the RoPE key, is the more sensitive path here."
                if all(r < 1 for r in rs)
                else "."
                if all(r > 1 for r in rs)
                else " -- neither path dominates at model level."
            )
            + " This model is a GQA model converted by RoRoPE (its RoPE key is the PCA-top two rotated KV "
            "heads, its latent carries the remaining keys AND all values), not a natively trained MLA model"
            + ("." if where == "inside" else ", so a different balance than the paper's models is not by itself a bug.")
        )
        lin = m["checks"].get(f"response_{lv_keys[0]}_over_{lv_keys[-1]}", {})
        if lin:
            out.append(
                "- Linearity: per-layer response at "
                + lv_keys[0]
                + " / at "
                + lv_keys[-1]
                + " lies in "
                + ", ".join(f"{p} [{v['min']:.3f}, {v['max']:.3f}]" for p, v in lin.items())
                + " -- at these levels the response is a property of the layer, not of the error size."
            )
        pm = m["predictor"]["metrics"]
        best = max(("operator_only", "operator_allocation"), key=lambda p: pm[p]["spearman"] or -2)
        out.append(
            f"- Predictor: on held-out layers `operator_allocation` reaches Spearman "
            f"{pm['operator_allocation']['spearman']:.2f} pooled, "
            f"{f2(pm['operator_allocation']['spearman_within_path']['content'])} / "
            f"{f2(pm['operator_allocation']['spearman_within_path']['rope'])} within the content / RoPE layers "
            f"(median |log error| {pm['operator_allocation']['median_abs_log_error']:.2f}, log-ratio MAE "
            f"{pm['operator_allocation']['log_ratio_mae']:.2f}) vs `operator_only` "
            f"{pm['operator_only']['spearman']:.2f} pooled, "
            f"{f2(pm['operator_only']['spearman_within_path']['content'])} / "
            f"{f2(pm['operator_only']['spearman_within_path']['rope'])} "
            f"({pm['operator_only']['median_abs_log_error']:.2f}); the better pooled ranking comes from `{best}`. "
            f"`cache_error_only` (matched NMSE => equal responses) has median |log error| "
            f"{pm['cache_error_only']['median_abs_log_error']:.2f}: the operator, weighted by where the error sits, "
            "sets the layer-wise gain"
            + (
                "; the operator alone (error spread evenly) is a weaker predictor."
                if pm["operator_only"]["median_abs_log_error"] > pm["operator_allocation"]["median_abs_log_error"]
                else "."
            )
        )
        iv = m.get("interventions_summary", {}).get(lv_keys[-1], {})
        if iv:
            out.append(
                f"- Interventions at {lv_keys[-1]} (mean relative response): "
                + "; ".join(f"{p}: " + ", ".join(f"{k} {v['mean']:.2f}" for k, v in by.items()) for p, by in iv.items())
                + ". Values far from 1 mean the response depends on WHERE the error sits (which tokens / "
                "channels), not only on its energy: the quantizer's error allocation matters in addition to "
                "the operator."
            )
    tiny = {n: m for n, m in models.items() if n.startswith("tiny_")}
    if tiny:
        rs = {n: m["error_model"]["model_level"][lv_keys[-1]]["ratio"] for n, m in tiny.items()}
        out.append(
            f"- Tiny random-init models at {lv_keys[-1]}: RoPE/content "
            + ", ".join(f"{n[5:]} {r:.2f}x" for n, r in rs.items())
            + ". Geometry only (random weights, random tokens): their attention is almost uniform (entropy "
            + ", ".join(
                f"{sum(a['relative_entropy'] for a in m['attention_stats']) / len(m['attention_stats']):.2f}"
                for m in tiny.values()
            )
            + " of uniform), so a key error barely moves the softmax and the RoPE path, which acts only through "
            "the logits, has almost no gain, while the content path also carries the values. They show that the "
            "pipeline runs on every family's RoPE/query layout; they say nothing about trained models."
        )
    return out
