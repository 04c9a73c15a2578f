"""The main job's results: scoring one method (per window, so every mean comes with its spread), one printed row per
method, and the headline, which leads with the measures that are stable across machines.

KL divergence to the full-precision model and top-1 agreement average a whole distribution at every position; the
perplexity difference between two good low-bit methods is a small difference of two noisy numbers, and its sign
followed the machine's floating-point paths (BLAS kernels, thread count) in our runs. So the headline reports KL and
top-1 first and the perplexity difference with its standard error over the scored windows.
"""

from __future__ import annotations

import math
import time

LABEL_WIDTH = 21  # "C4R4 QuantMLA shipped"
HEADER = f"   {'cache':{LABEL_WIDTH}} {'ppl':>8} {'KL 1e-3':>9} {'top-1':>8} {'cache MB':>9} {'vs BF16':>8}"


def score(model, ids, reference, fmt: str, context: int, policy) -> dict:
    """Every position of ``ids`` [N] (windows of ``context``) through a fresh ``fmt`` cache per window, against the
    model's own forward without a cache (``reference`` [W, context, V]:
    :func:`quantmla.eval.perplexity.reference_logprobs`). Means over all windows, plus the per-window values.

    The model runs in absorbed form over ``QuantMLACache``; its per-query mixed-precision policy makes one prefill
    forward see exactly what token-by-token decoding would see (tested), so one forward per window scores every
    position as if it had been decoded.
    """
    from quantmla.eval.perplexity import perplexity
    from quantmla.eval.runtime import CacheSpec
    from quantmla.mla.spec import MLASpec
    from quantmla.quant.formats import cache_bytes

    t0 = time.perf_counter()
    spec_cache = CacheSpec(fmt, policy.sink, policy.local)
    wins = [perplexity(model, ids[w * context : (w + 1) * context], context=context, cache=spec_cache,
                       reference=reference[w : w + 1]) for w in range(reference.shape[0])]  # fmt: skip
    nll = [r.nll for r in wins]  # nats / scored token, one per window (each scores context - 1 tokens)
    spec = MLASpec.from_config(model.config)
    kw = dict(kv_lora_rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim, num_layers=spec.num_cache_layers,
              context=context, policy=policy)  # fmt: skip
    phys = cache_bytes(fmt, **kw).total  # cache_bytes adapts the groups to the model's widths, as the cache does
    return {
        "format": fmt,
        "perplexity": math.exp(sum(nll) / len(nll)),
        "kl_to_full_precision": sum(r.kl_to_reference for r in wins) / len(wins),
        "top1_agreement": sum(r.top1_agreement for r in wins) / len(wins),
        "window_nll": nll,
        "cache_bytes_bf16_model": phys,
        "compression_vs_bf16": cache_bytes("bf16", **kw).total / phys,
        "seconds_cpu": time.perf_counter() - t0,
    }


def results_row(label: str, r: dict) -> str:
    """One printed row of the results table (see :data:`HEADER`)."""
    kl = max(r["kl_to_full_precision"], 0.0)  # >= 0 in exact arithmetic; rounding can leave -1e-9
    return (
        f"   {label:{LABEL_WIDTH}} {r['perplexity']:8.3f} {1e3 * kl:9.3f} {r['top1_agreement']:8.3f}"
        f" {r['cache_bytes_bf16_model'] / 1e6:9.2f} {r['compression_vs_bf16']:7.2f}x"
    )


def print_results(rows: list[dict]) -> None:
    """The results table: one row per method (``label`` + the fields of :func:`score`)."""
    print(HEADER)
    for r in rows:
        print(results_row(r["label"], r))


def paired_log_ppl_diff(a: dict, b: dict) -> tuple[float, float]:
    """Mean and standard error over windows of ``log ppl(a) - log ppl(b)`` (nan spread with one window)."""
    d = [x - y for x, y in zip(a["window_nll"], b["window_nll"], strict=True)]
    mean = sum(d) / len(d)
    if len(d) < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return mean, math.sqrt(var / len(d))


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"


def accuracy_summary(bf16: dict, rtn: dict, qm: dict) -> dict:
    """KL, top-1 and perplexity of QuantMLA against RTN and full precision (the numbers of the headline)."""
    rtn_kl = rtn["kl_to_full_precision"]
    gap = rtn["perplexity"] - bf16["perplexity"]
    diff, se = paired_log_ppl_diff(qm, rtn)
    return {
        "kl_removed_vs_rtn": 1 - qm["kl_to_full_precision"] / rtn_kl if rtn_kl > 0 else float("nan"),
        "top1_quantmla": qm["top1_agreement"],
        "top1_rtn": rtn["top1_agreement"],
        "ppl_increase_vs_bf16": qm["perplexity"] / bf16["perplexity"] - 1,
        "rtn_ppl_increase_vs_bf16": rtn["perplexity"] / bf16["perplexity"] - 1,
        "log_ppl_diff_vs_rtn": diff,  # < 0: QuantMLA's perplexity is lower than RTN's
        "log_ppl_diff_vs_rtn_se": se,  # standard error over the scored windows (paired)
        "windows": len(qm["window_nll"]),
        "ppl_gap_closed_vs_rtn": (rtn["perplexity"] - qm["perplexity"]) / gap if gap > 0 else float("nan"),
    }


def accuracy_headline(s: dict, fmt: str, bf16: dict, rtn: dict, qm: dict, context: int) -> list[str]:
    """The 'Accuracy kept' lines: KL and top-1 first, perplexity with its spread second."""
    diff, se = s["log_ppl_diff_vs_rtn"], s["log_ppl_diff_vs_rtn_se"]
    if math.isnan(se):
        verdict = "one window: no spread"
    elif abs(diff) < 2 * se:
        verdict = "within 2 standard errors: too close to call at this budget"
    else:
        verdict = "QuantMLA lower" if diff < 0 else "QuantMLA higher"
    cut = s["kl_removed_vs_rtn"]
    kl = f"removes {_pct(cut)} of" if not cut < 0 else f"has {_pct(-cut)} more than"
    return [
        f"== Accuracy kept ({fmt}): QuantMLA {kl} RTN's KL divergence from full "
        f"precision ({1e3 * rtn['kl_to_full_precision']:.3f} -> {1e3 * qm['kl_to_full_precision']:.3f} x 1e-3 "
        f"nats/token) and keeps the full-precision top-1 token at {qm['top1_agreement']:.3f} of positions "
        f"(RTN {rtn['top1_agreement']:.3f}).",
        f"   Perplexity {qm['perplexity']:.3f} vs {bf16['perplexity']:.3f} full precision "
        f"({100 * s['ppl_increase_vs_bf16']:+.2f}%; RTN {rtn['perplexity']:.3f}, "
        f"{100 * s['rtn_ppl_increase_vs_bf16']:+.2f}%); QuantMLA vs RTN {100 * math.expm1(diff):+.2f}% "
        f"+- {100 * se:.2f}% ({s['windows']} windows of {context} tokens; {verdict}).",
    ]
