"""Dual-path error-model numbers (issue #4): content vs RoPE response at matched cache NMSE, equal-energy
interventions and the first-order predictor, on the converted SmolLM2-135M-MLA model and on tiny random-init models
of every supported family (paper Tables 4, 5, 6 and Figure 6), on ONE CPU thread.

For every model, every attention layer and every cache-NMSE level, the format's real QDQ error of one path
(content latent or RoPE key), rescaled to the level, is added to that path only and the attention-output NMSE is
measured (``quantmla.analysis.error_model``); the predictor (``quantmla.analysis.predictor``) forecasts the same
responses from operator traces and is scored on held-out (odd-index) layers. Writes
``benchmarks/results/analysis.{json,md}`` and the real model's atlas ``analysis_atlas_smollm2_nmse*.png``.

    python benchmarks/analysis_results.py                  # ~10 min on one CPU thread (shared 2-core box)
    python benchmarks/analysis_results.py --skip-real      # tiny models only (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis_report import REAL, write  # noqa: E402 - the tables, figures and reading of the results


def _tiny_overrides(name: str, layers: int) -> dict:
    """Depth overrides so that every tiny family has ``layers`` attention modules (more held-out layers)."""
    if name == "longcat_flash":  # two attention modules per block
        return {"num_layers": max(1, layers // 2)}
    if name == "glm4_moe_lite":
        return {"num_hidden_layers": layers, "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1)}
    return {"num_hidden_layers": layers}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check(name: str, rep, pred, levels, n_layers: int) -> dict:
    """Correctness checks of one model's results (raise on failure); returns linearity / consistency stats."""
    assert rep.levels == levels, (name, rep.levels, levels)
    for lv in levels:
        rows = rep.at(lv)
        assert len(rows) == n_layers, f"{name}: {len(rows)} layers at {lv}, expected {n_layers}"
        assert len({r.layer for r in rows}) == n_layers, f"{name}: duplicate layer ids"
    for r in rep.layers:
        for k in ("content_out_nmse", "rope_out_nmse", "content_response", "rope_response", "ratio"):
            v = getattr(r, k)
            assert _finite(v) and v > 0, f"{name} layer {r.layer} @ {r.cache_nmse}: {k} = {v}"
        assert math.isclose(r.content_response, r.content_out_nmse / r.cache_nmse, rel_tol=1e-9)
        assert math.isclose(r.ratio, r.rope_response / r.content_response, rel_tol=1e-9)
        for path in ("content", "rope"):
            for kind, v in r.interventions.get(path, {}).items():
                assert _finite(v) and v > 0, f"{name} layer {r.layer}: intervention {path}/{kind} = {v}"
    # the predictor re-measures the same responses (same seed, queries and error): they must agree
    by = {(r.layer, r.cache_nmse): r for r in rep.layers}
    worst = 0.0
    for p in pred.points:
        r = by[(p.layer, p.cache_nmse)]
        want = r.content_response if p.path == "content" else r.rope_response
        worst = max(worst, abs(p.measured / want - 1))
        for k, v in p.predicted.items():
            assert _finite(v) and v > 0, f"{name} layer {p.layer}: predictor {k} = {v}"
    assert worst < 1e-4, f"{name}: predictor's measured responses differ from the error model's by {worst:.2e}"
    # small errors act linearly: the gain should barely depend on the level
    lin = {}
    if len(levels) >= 2:
        a, b = levels[0], levels[1]
        for path in ("content", "rope"):
            ratios = []
            for ra, rb in zip(rep.at(a), rep.at(b), strict=True):
                va = ra.content_response if path == "content" else ra.rope_response
                vb = rb.content_response if path == "content" else rb.rope_response
                ratios.append(va / vb)
            lin[path] = {"min": min(ratios), "max": max(ratios)}
    return {"measured_consistency_max_rel_diff": worst, f"response_{levels[0]:g}_over_{levels[-1]:g}": lin}


@torch.no_grad()
def attention_stats(model, tokens: torch.Tensor) -> list[dict]:
    """Per attention layer, on the first sequence: std of the content and RoPE logit terms (scaled, causal pairs)
    and the attention entropy relative to uniform over the visible keys (1 = uniform; queries 1..S-1)."""
    from quantmla.calibrate.objectives import layer_inputs
    from quantmla.calibrate.trainer import iter_attention_inputs
    from quantmla.mla.spec import MLASpec
    from quantmla.mla.weights import extract_layer_weights

    spec = MLASpec.from_config(model.config)
    out = []
    for attn, h, cos, sin in iter_attention_inputs(model, tokens[:1], 1, torch.device("cpu")):
        w = extract_layer_weights(attn).to(dtype=torch.float32)
        x = layer_inputs(w, spec, h, cos, sin)
        lc = torch.einsum("bhic,bjc->bhij", x.q_lat, x.c) * spec.softmax_scale
        lr = torch.einsum("bhir,bjr->bhij", x.q_pe, x.k_pe) * spec.softmax_scale
        p = torch.softmax((lc + lr).masked_fill(~x.mask, float("-inf")), dim=-1)
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)[..., 1:]  # [B, H, S-1]
        uniform = torch.log(torch.arange(2, p.shape[-1] + 1, dtype=torch.float32))
        out.append(
            {
                "layer": attn.layer_idx,
                "content_logit_std": float(lc[..., x.mask].std()),
                "rope_logit_std": float(lr[..., x.mask].std()),
                "relative_entropy": float((ent / uniform).mean()),
            }
        )
    return out


def run_model(name, model, tokens, args, levels, kinds, batch_size, query_tokens) -> dict:
    from quantmla.analysis.error_model import analyze_model
    from quantmla.analysis.predictor import predict_model
    from quantmla.mla.spec import MLASpec

    spec = MLASpec.from_config(model.config)
    t0 = time.time()
    rep = analyze_model(
        model,
        tokens,
        args.format,
        levels,
        batch_size,
        query_tokens,
        kinds,
        args.repeats,
        "cpu",
        progress=False,
        seed=args.seed,
    )
    t1 = time.time()
    pred = predict_model(
        model, tokens, args.format, levels, batch_size, query_tokens, "cpu", progress=False, seed=args.seed
    )
    t2 = time.time()
    checks = check(name, rep, pred, levels, spec.num_cache_layers)
    stats = attention_stats(model, tokens)
    print(
        f"{name}: {spec.num_cache_layers} attention layers, error model {t1 - t0:.0f}s, predictor {t2 - t1:.0f}s, "
        f"model level {json.dumps(rep.model_level())}",
        flush=True,
    )
    return {
        "model_type": spec.model_type,
        "num_layers": spec.num_cache_layers,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "num_heads": spec.num_heads,
        "tokens": list(tokens.shape),
        "query_tokens": query_tokens,
        "batch_size": batch_size,
        "error_model": rep.to_dict(),
        "predictor": pred.to_dict(),
        "checks": checks,
        "attention_stats": stats,
        "wall_s": {"error_model": t1 - t0, "predictor": t2 - t1},
        "_report": rep,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="c4r4", help="format whose quantizers give the error geometry")
    ap.add_argument("--levels", default="1e-2,1e-3", help="cache NMSE levels")
    ap.add_argument("--corpus", default=None, help="calibration text source (default: quantmla.data.corpus default)")
    ap.add_argument("--seqs", type=int, default=4, help="real model: calibration sequences")
    ap.add_argument("--seq-len", type=int, default=512, help="real model: tokens per sequence")
    ap.add_argument("--query-tokens", type=int, default=256, help="real model: sampled query positions per sequence")
    ap.add_argument("--repeats", type=int, default=2, help="draws per equal-energy intervention")
    ap.add_argument("--interventions", default="sign,token_permutation,isotropic")
    ap.add_argument("--tiny", default="deepseek_v2,deepseek_v3,deepseek_v3_half,glm4_moe_lite,longcat_flash")
    ap.add_argument("--tiny-layers", type=int, default=8, help="attention modules per tiny model")
    ap.add_argument("--tiny-seqs", type=int, default=8)
    ap.add_argument("--tiny-seq-len", type=int, default=256)
    ap.add_argument("--tiny-query-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--tag", default="analysis")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [float(v) for v in args.levels.split(",") if v.strip()]
    kinds = tuple(k for k in args.interventions.split(",") if k)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:])

    from quantmla.data import corpus as corpora
    from quantmla.mla.tiny import TINY_MODELS, tiny_model

    t_start = time.time()
    models: dict[str, dict] = {}
    if not args.skip_real:
        from quantmla.models.convert import converted_model_dir, load_model

        path = converted_model_dir(progress=False)
        model, tok = load_model(path)
        source = args.corpus or corpora.DEFAULT_SOURCE
        ids = corpora.token_stream(tok, source, "calibration", args.seqs * args.seq_len).view(args.seqs, args.seq_len)
        res = run_model(REAL, model, ids, args, levels, kinds, args.seqs, args.query_tokens)
        res["source"] = {
            "checkpoint": os.path.basename(path),
            "tokens": f"{source} calibration split, first {args.seqs} x {args.seq_len} tokens",
        }
        models[REAL] = res
        write(models, args, levels, command, time.time() - t_start, quiet=True)
        del model
    for name in [n for n in args.tiny.split(",") if n]:
        if name not in TINY_MODELS:
            raise SystemExit(f"unknown tiny model {name!r}; quantmla.mla.tiny has {TINY_MODELS}")
        model = tiny_model(name, seed=args.seed, **_tiny_overrides(name, args.tiny_layers))
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, model.config.vocab_size, (args.tiny_seqs, args.tiny_seq_len), generator=gen)
        res = run_model(f"tiny_{name}", model, ids, args, levels, kinds, args.tiny_seqs, args.tiny_query_tokens)
        res["source"] = {
            "checkpoint": f"quantmla.mla.tiny.tiny_model({name!r}, seed={args.seed}, "
            f"{_tiny_overrides(name, args.tiny_layers)})",
            "tokens": "uniform random token ids",
        }
        models[f"tiny_{name}"] = res
        write(models, args, levels, command, time.time() - t_start, quiet=True)
    write(models, args, levels, command, time.time() - t_start)


if __name__ == "__main__":
    main()
