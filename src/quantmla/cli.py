"""``quantmla <command>``: the command-line interface.

Commands: ``run`` (the main job on the embedded default), ``info`` (cache bytes per format),
``generate`` (text generation with a quantized cache), plus ``convert``, ``eval`` and ``calibrate``
where those modules are installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from quantmla.quant.formats import FORMATS, CachePolicy, cache_bytes, get_format

GIB = 1024**3


# -- info ------------------------------------------------------------------------------------------
def _load_dims(args) -> tuple[str, int, int, int]:
    from quantmla.presets import PRESETS, cache_dims

    if args.model_config and args.preset:
        raise SystemExit("error: give either --model-config or --preset, not both")
    if args.model_config:
        try:
            with open(args.model_config) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise SystemExit(f"error: --model-config {args.model_config!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --model-config {args.model_config!r} is not valid JSON: {e}") from None
        label = args.model_config
    else:
        key = (args.preset or "deepseek-v2-lite").lower()
        if key not in PRESETS:
            raise SystemExit(f"error: unknown --preset {key!r}; choose one of {', '.join(PRESETS)}")
        cfg, label = PRESETS[key], key
    try:
        dc, dr, layers = cache_dims(cfg)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return label, dc, dr, layers


def info_table(dc: int, dr: int, layers: int, context: int, batch: int, policy: CachePolicy, formats) -> list[dict]:
    base = cache_bytes("bf16", kv_lora_rank=dc, rope_dim=dr, num_layers=layers, context=context, batch=batch,
                       policy=policy).total
    rows = []
    for fmt in formats:
        f = get_format(fmt).adapted(dc, dr)
        b = cache_bytes(f, kv_lora_rank=dc, rope_dim=dr, num_layers=layers, context=context, batch=batch,
                        policy=policy)
        rows.append(
            {
                "format": f.name,
                "bytes_per_token_layer": f.bytes_per_token(dc, dr),
                "bytes_per_token_all_layers": b.total / max(1, context * batch),
                "total_bytes": b.total,
                "gib_per_sequence": b.total / max(1, batch) / GIB,
                "compression_vs_bf16": base / b.total if b.total else float("nan"),
                "packed_bytes": b.packed,
                "scale_bytes": b.scales,
                "bf16_buffer_bytes": b.bf16_buffers,
                "metadata_bytes": b.metadata,
            }
        )
    return rows


def cmd_info(args) -> int:
    label, dc, dr, layers = _load_dims(args)
    try:
        policy = CachePolicy(sink=args.sink, local=args.local, page_size=args.page_size)
        chosen = get_format(args.format).adapted(dc, dr) if args.format else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.context <= 0 or args.batch <= 0:
        raise SystemExit("error: --context and --batch must be positive")
    names = list(FORMATS)
    if chosen is not None and chosen.name not in names:
        names.append(chosen.name)
    rows = info_table(dc, dr, layers, args.context, args.batch, policy, names)
    meta = {"model": label, "kv_lora_rank": dc, "rope_dim": dr, "cache_layers": layers, "context": args.context,
            "batch": args.batch, "sink": policy.sink, "local": policy.local, "page_size": policy.page_size}
    if args.json:
        print(json.dumps({**meta, "formats": rows}, indent=2))
        return 0
    print(f"{label}: latent {dc} + RoPE {dr}, {layers} cache layers; context {args.context:,} x batch {args.batch};"
          f" sink {policy.sink}, local {policy.local}, page {policy.page_size}")
    print(f"{'format':8} {'B/token/layer':>13} {'B/token':>10} {'GiB/seq':>9} {'compression':>11}")
    for r in rows:
        mark = " <" if chosen is not None and r["format"] == chosen.name else ""
        print(f"{r['format']:8} {r['bytes_per_token_layer']:>13} {r['bytes_per_token_all_layers']:>10.1f} "
              f"{r['gib_per_sequence']:>9.3f} {r['compression_vs_bf16']:>10.2f}x{mark}")
    return 0


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="physical cache bytes per format for a model config")
    p.add_argument("--model-config", help="a model's config.json (any supported MLA model)")
    p.add_argument("--preset", help="a known model instead: deepseek-v2-lite (default), deepseek-v3, kimi-k2, ...")
    p.add_argument("--format", help="highlight this format (e.g. c4r4, or any c<bits>r<bits>)")
    p.add_argument("--context", type=int, default=131072, help="tokens per sequence (default 131072)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)


# -- generate --------------------------------------------------------------------------------------
def load_model(path: str, dtype: str = "float32"):
    """Load a local model directory (no network) and its tokenizer; ``quantmla_mla`` models included."""
    import os

    import torch

    from quantmla.models.convert import load_model as _load

    if not os.path.isdir(path):
        raise SystemExit(f"error: --model {path!r} is not a directory (a local model directory is required)")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return _load(path, dtype=dt)


def cmd_generate(args) -> int:
    import torch

    from quantmla.cache.hf import QuantMLACache
    from quantmla.compat import with_cache

    try:
        fmt = get_format(args.format)
        policy = CachePolicy(sink=args.sink, local=args.local)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.max_new_tokens <= 0:
        raise SystemExit("error: --max-new-tokens must be positive")
    model, tok = load_model(args.model, args.dtype)
    try:
        cache = QuantMLACache(model.config, fmt, policy)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.absorbed:
        from quantmla.mla.attention import enable_absorbed_attention

        enable_absorbed_attention(model)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **with_cache(cache))
    dt = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    rep = cache.memory_report()
    print(f"\n[{fmt.name}] {new} tokens in {dt:.2f} s ({new / dt:.1f} tok/s, CPU-side wall clock incl. prefill); "
          f"cache: {rep['tokens']} tokens, {rep['physical_bytes_bf16_model']:,} B physical "
          f"({rep['compression_vs_bf16']:.2f}x smaller than BF16), {rep['allocated_bytes']:,} B allocated here")
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a quantized dual-path cache")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--format", default="c4r4")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--absorbed", action="store_true", help="attend in absorbed form over the quantized cache")
    p.set_defaults(func=cmd_generate)


# -- wiring ----------------------------------------------------------------------------------------
def _optional(sub, module: str, adder: str) -> None:
    """Commands that live in optional modules (convert, eval, calibrate) register themselves if present."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    fn = getattr(mod, adder, None)
    if fn is not None:
        fn(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantmla", description="Low-bit dual-path KV cache for MLA models (QuantMLA).")
    sub = p.add_subparsers(dest="command")
    from quantmla.main_job import add_run_args

    add_run_args(sub)
    _add_info(sub)
    _add_generate(sub)
    _optional(sub, "quantmla.models.cli", "add_convert_args")
    _optional(sub, "quantmla.eval.cli", "add_eval_args")
    _optional(sub, "quantmla.calibrate.cli", "add_calibrate_args")
    _optional(sub, "quantmla.analysis.cli", "add_analyze_args")
    _optional(sub, "quantmla.calibrate.stream_cli", "add_stream_args")  # calibrate-stream, merge
    _optional(sub, "quantmla.analysis.allocate_cli", "add_allocate_args")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
