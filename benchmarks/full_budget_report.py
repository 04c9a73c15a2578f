"""The report of ``benchmarks/full_budget.py``: the methods it compares and their labels, and its results written as
JSON, a markdown table per (variant, format) with per-seed spreads and the share of RTN's gap QuantMLA closes, and a
bar plot of KL to full precision (temp file, then rename, like every result here)."""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess

from full_budget_reuse import reuse_line

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"a": "smollm2-mla", "b": "smollm2-mla-b-healed"}


def variant_dir(v: str) -> str:
    """A variant's model folder, built offline on first use (a: the conversion; b: the healed conversion)."""
    from quantmla.models.convert import ConvertConfig, converted_model_dir, healed_model_dir

    return converted_model_dir("smollm2", ConvertConfig(variant="a")) if v == "a" else healed_model_dir()


def read_results(stem: str, work: str) -> dict | None:
    """The fuller (more units) of a run's results file ``<stem>.json`` and its mirror ``<work>/results.json`` (a
    device call's fresh working tree has lost the results file of the call before it; the work folder outside the
    tree has not); None when neither exists."""
    out = None
    for path in (stem + ".json", os.path.join(work, "results.json")):
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
            if out is None or len(r["units"]) > len(out["units"]):
                out = r
    return out


METHODS = {  # label -> (CalibrationConfig.method, overrides); each QuantMLA label names its RoPE objective, so a
    # change of CalibrationConfig's default never changes what a label's rows (and a resumed tag's seeds) mean
    "rtn": ("rtn", {}),
    "quantmla": ("quantmla", {"rope_weighting": "uniform"}),
    "smoothquant": ("smoothquant", {}),
    "quarot": ("quarot", {}),
    "quantmla-attnw": ("quantmla", {"rope_weighting": "attention"}),
}
LABELS = {"rtn": "RTN", "quantmla": "QuantMLA, the paper's uniform RoPE objective", "smoothquant": "SmoothQuant-MLA",
          "quarot": "QuaRot-MLA", "quantmla-attnw": "QuantMLA, attention-weighted RoPE objective (ours: the default)"}
BASELINES = ("rtn", "smoothquant", "quarot")
SHORT = {"quantmla": "QuantMLA (uniform RoPE)", "quantmla-attnw": "QuantMLA (attn.-weighted)"}  # summary, plot


def check_rope_rounding(results: dict, want: str, what: str) -> None:
    """SystemExit unless ``results`` (``what``: its file or shard, for the message) holds no unit or was evaluated
    with ``--rope-rounding want`` (results from before the option rounded to nearest): one table, one rounding."""
    had = results.get("rope_rounding", "nearest")
    if results.get("units") and had != want:
        raise SystemExit(f"{what}: its units were evaluated with --rope-rounding {had}, not {want}: pass "
                         f"--rope-rounding {had}, another --tag, or --force")  # fmt: skip


def _rows(results: dict, args) -> dict:
    """(variant, format) -> method label -> list of per-seed ppl results; plus retrieval by method."""
    table: dict = {}
    for r in results["units"].values():
        if r["kind"] not in ("ppl", "niah"):
            continue
        cell = table.setdefault((r["variant"], r["format"]), {}).setdefault(r["method"] or "bf16", {"ppl": {},
                                                                                                  "niah": None})
        if r["kind"] == "ppl":
            cell["ppl"][r["seed"]] = r["result"]
        else:
            cell["niah"] = r["result"]
    return table


def _fmt_seeds(vals: list[float], scale: float = 1.0, digits: int = 3) -> str:
    if not vals:
        return "-"
    m = sum(vals) / len(vals)
    if len(vals) == 1:
        return f"{scale * m:.{digits}f}"
    return f"{scale * m:.{digits}f} ± {scale * (max(vals) - min(vals)) / 2:.{digits}f}"


ROUNDING_WORDS = {"nearest": "to nearest", "query-aware": "query-aware (fitted to the stored query moments)",
                  "rotated": "query-aware after the stored post-RoPE Hadamard rotation"}


def current_commit() -> str:
    """The checkout's short commit: ``QUANTMLA_COMMIT`` where the tree has no .git (a device call's copy)."""
    return os.environ.get("QUANTMLA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()  # fmt: skip


def write(results: dict, stem: str, args) -> None:
    commit = current_commit()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results.update(date=date, commit=commit, command=args.command, args={k: v for k, v in vars(args).items()})
    table = _rows(results, args)
    devices = sorted({r.get("device", "?") for r in results["units"].values()})
    lines = [f"# QuantMLA at the {args.preset} calibration budget vs baselines, SmolLM2-MLA ({date}, commit {commit})",
             "", f"Device: {', '.join(devices)}. Command: `{args.command}`. Perplexity / KL (1e-3 nats/token) / top-1 "
             f"agreement with the full-precision model on {args.ppl_tokens} test tokens per corpus, windows of "
             f"{args.ppl_context}, cache policy sink 4 / local 128, RoPE key of the calibrated rows rounded "
             f"{ROUNDING_WORDS[getattr(args, 'rope_rounding', 'nearest')]}; a row of several calibration seeds "
             f"(its seeds column): mean ± half-range over them. "
             + (f"Retrieval: correct / samples (depths 0.1/0.5/0.9 x {args.samples}), seed {args.seeds[0]}."
                if args.tasks else "No retrieval.")
             + (" " + reused if (reused := reuse_line(results)) else ""),
             ""]  # fmt: skip
    niah_keys = sorted({k for cells in table.values() for c in cells.values() if c["niah"] for k in c["niah"]},
                       key=lambda k: (k.split("@")[0], int(k.split("@")[1])))  # fmt: skip
    order = {f: i for i, f in enumerate(args.formats)}
    for (v, f), cells in sorted(table.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], -1))):
        if f == "bf16":
            continue
        lines += [f"## variant {v} ({VARIANTS[v]}), {f.upper()}", ""]
        head = ["method", "seeds"] + [f"{c} {m}" for c in args.corpora for m in ("ppl", "KL", "top-1")] + niah_keys
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        ordered = [("BF16", table.get((v, "bf16"), {}).get("bf16"))] + [
            (LABELS[m], cells.get(m)) for m in METHODS if m in cells]  # fmt: skip
        for label, cell in ordered:
            if cell is None:
                continue
            row = [label, ", ".join(str(k) for k in sorted(cell["ppl"])) if label != "BF16" else "-"]
            seeds = list(cell["ppl"].values())
            for c in args.corpora:
                row += [_fmt_seeds([s[c]["ppl"] for s in seeds if c in s]),
                        _fmt_seeds([max(s[c]["kl"], 0.0) for s in seeds if c in s], 1e3, 2),
                        _fmt_seeds([s[c]["top1"] for s in seeds if c in s])]  # fmt: skip
            row += [f"{cell['niah'][k][0]}/{cell['niah'][k][1]}" if cell["niah"] and k in cell["niah"] else "-"
                    for k in niah_keys]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
        lines += _summary(table, v, f, args) + [""]
    out = {"json": json.dumps(results, indent=1, default=str), "md": "\n".join(lines) + "\n"}
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    for ext, text in out.items():
        with open(f"{stem}.{ext}.tmp", "w") as fh:
            fh.write(text)
        os.replace(f"{stem}.{ext}.tmp", f"{stem}.{ext}")
    _plot(table, stem + ".png", args)


def _mean(cell, corpus, key):
    vals = [s[corpus][key] for s in cell["ppl"].values() if corpus in s] if cell else []
    return sum(vals) / len(vals) if vals else None


def retrieval_vs(niah: dict | None, ref: dict | None) -> tuple[int, int, int, int, float, float] | None:
    """Retrieval summed over the cells both results hold: (correct, samples, reference correct, reference samples,
    difference of the two rates in points, half-width of its 95% normal interval in points); None without cells."""
    keys = sorted(set(niah or {}) & set(ref or {}))
    if not keys:
        return None
    c, n = sum(niah[k][0] for k in keys), sum(niah[k][1] for k in keys)
    rc, rn = sum(ref[k][0] for k in keys), sum(ref[k][1] for k in keys)
    if not n or not rn:
        return None
    p, rp = c / n, rc / rn
    return c, n, rc, rn, 100 * (p - rp), 100 * 1.96 * math.sqrt(p * (1 - p) / n + rp * (1 - rp) / rn)


def _summary(table, v, f, args) -> list[str]:
    """Per corpus and QuantMLA objective: the share of RTN's KL and perplexity gap it removes, and whether its KL
    is below every baseline's (RTN, SmoothQuant-MLA, QuaRot-MLA); then each method's retrieval over all cells
    against BF16's, with the 95% interval of the difference (the issue's target: within 2 points of BF16)."""
    cells, bf = table.get((v, f), {}), table.get((v, "bf16"), {}).get("bf16")
    out, retrieval = [], []
    for label in METHODS:
        r = retrieval_vs(cells.get(label, {}).get("niah"), bf and bf["niah"])
        if r is not None:
            c, n, rc, rn, d, w = r
            name = SHORT.get(label, LABELS[label])
            retrieval.append(f"- retrieval, {name}: {c}/{n} ({100 * c / n:.1f}%) vs BF16 {rc}/{rn} "
                             f"({100 * rc / rn:.1f}%): {d:+.1f} points, 95% interval {d - w:+.1f} to "
                             f"{d + w:+.1f}.")  # fmt: skip
    for c in args.corpora:
        rtn, rp, b = _mean(cells.get("rtn"), c, "kl"), _mean(cells.get("rtn"), c, "ppl"), _mean(bf, c, "ppl")
        for label in ("quantmla", "quantmla-attnw"):
            qm, qp = _mean(cells.get(label), c, "kl"), _mean(cells.get(label), c, "ppl")
            if None in (rtn, qm, rp, qp, b):
                continue
            gap = (rp - qp) / (rp - b) if rp > b else float("nan")
            base = [_mean(cells[m], c, "kl") for m in BASELINES if m in cells]
            best = all(qm <= k for k in base if k is not None)
            verdict = "yes" if best else "no"
            out.append(f"- {c}, {SHORT[label]}: removes {100 * (1 - qm / rtn):.0f}% of RTN's KL and closes "
                       f"{100 * gap:.0f}% of its perplexity gap; KL below every baseline's: {verdict}.")  # fmt: skip
    out += retrieval
    return [""] + out if out else []


def _plot(table, path, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted(k for k in table if k[1] != "bf16")
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    c = args.corpora[0]
    for ax, (v, f) in zip(axes[0], keys):
        cells = table[(v, f)]
        names = [m for m in METHODS if m in cells]
        for i, m in enumerate(names):
            vals = [1e3 * s[c]["kl"] for s in cells[m]["ppl"].values() if c in s]
            if vals:
                ax.bar(i, sum(vals) / len(vals), yerr=(max(vals) - min(vals)) / 2 if len(vals) > 1 else 0, capsize=3)
        ticks = [SHORT[m].replace(" (", "\n(") if m in SHORT else LABELS[m] for m in names]
        ax.set_xticks(range(len(names)), ticks, rotation=30, fontsize=7)
        ax.set_title(f"variant {v}, {f.upper()}: KL to full precision ({c})", fontsize=8)
        ax.set_ylabel("KL, 1e-3 nats/token")
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
