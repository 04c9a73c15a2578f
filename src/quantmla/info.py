"""``quantmla info``: the physical cache bytes of every format for a model config or a known model (no weights).

Usage::

    quantmla info --preset deepseek-v3 --format c4r4 --context 131072
    quantmla info --model-config path/to/config.json --json
"""

from __future__ import annotations

import json
import os

from quantmla.cli_support import UsageError, usage_errors

GIB = 1024**3
MAX_TOKENS = 2**40  # context x batch; beyond this the GiB column stops being a number anyone means


def read_model_config(path: str) -> dict:
    """A model's config.json as a dict (a folder holding config.json works too); UsageError on anything else."""
    if os.path.isdir(path):
        inner = os.path.join(path, "config.json")
        if not os.path.isfile(inner):
            raise UsageError(f"--model-config {path} is a folder without config.json; give the config.json file")
        path = inner
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"--model-config {path} does not exist; give a model's config.json") from None
    except UnicodeDecodeError:
        raise UsageError(f"--model-config {path} is not UTF-8 text; give a model's config.json") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--model-config {path} is not valid JSON ({e}); give a model's config.json") from None
    except OSError as e:
        raise UsageError(f"--model-config {path} cannot be read ({e.strerror})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--model-config {path} holds a JSON {type(cfg).__name__}, not an object like config.json")
    return cfg


def _load_dims(args) -> tuple[str, int, int, int]:
    from quantmla.presets import PRESETS, cache_dims

    if args.model_config and args.preset:
        raise UsageError("give either --model-config or --preset, not both")
    if args.model_config:
        cfg, label = read_model_config(args.model_config), args.model_config
    else:
        key = (args.preset or "deepseek-v2-lite").lower()
        if key not in PRESETS:
            raise UsageError(f"unknown --preset {key!r}; choose one of {', '.join(PRESETS)}")
        cfg, label = PRESETS[key], key
    with usage_errors(f"{label}: "):
        dc, dr, layers = cache_dims(cfg)
    return label, dc, dr, layers


def info_table(dc: int, dr: int, layers: int, context: int, batch: int, policy, formats) -> list[dict]:
    """One dict per format: bytes per token (one layer, all layers), total bytes, GiB per sequence, compression."""
    from quantmla.quant.formats import cache_bytes, get_format

    base = cache_bytes("bf16", kv_lora_rank=dc, rope_dim=dr, num_layers=layers, context=context, batch=batch,
                       policy=policy).total  # fmt: skip
    rows = []
    for fmt in formats:
        f = get_format(fmt).adapted(dc, dr)
        b = cache_bytes(f, kv_lora_rank=dc, rope_dim=dr, num_layers=layers, context=context, batch=batch,
                        policy=policy)  # fmt: skip
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
    from quantmla.quant.formats import FORMATS, CachePolicy, get_format

    label, dc, dr, layers = _load_dims(args)
    if args.context <= 0 or args.batch <= 0:
        raise UsageError("--context and --batch must be positive")
    if args.context * args.batch > MAX_TOKENS:
        raise UsageError(f"--context x --batch = {args.context * args.batch:.3g} tokens; use at most 2**40")
    with usage_errors():
        policy = CachePolicy(sink=args.sink, local=args.local, page_size=args.page_size)
        chosen = get_format(args.format).adapted(dc, dr) if args.format else None
    names = list(FORMATS)
    if chosen is not None and chosen.name not in names:
        names.append(chosen.name)
    with usage_errors(f"{label}: "):
        rows = info_table(dc, dr, layers, args.context, args.batch, policy, names)
    meta = {
        "model": label,
        "kv_lora_rank": dc,
        "rope_dim": dr,
        "cache_layers": layers,
        "context": args.context,
        "batch": args.batch,
        "sink": policy.sink,
        "local": policy.local,
        "page_size": policy.page_size,
    }
    if args.json:
        print(json.dumps({**meta, "formats": rows}, indent=2))
        return 0
    print(
        f"{label}: latent {dc} + RoPE {dr}, {layers} cache layers; context {args.context:,} x batch {args.batch};"
        f" sink {policy.sink}, local {policy.local}, page {policy.page_size}"
    )
    print(f"{'format':8} {'B/token/layer':>13} {'B/token':>10} {'GiB/seq':>9} {'compression':>11}")
    for r in rows:
        mark = " <" if chosen is not None and r["format"] == chosen.name else ""
        print(
            f"{r['format']:8} {r['bytes_per_token_layer']:>13} {r['bytes_per_token_all_layers']:>10.1f} "
            f"{r['gib_per_sequence']:>9.3f} {r['compression_vs_bf16']:>10.2f}x{mark}"
        )
    return 0


def add_info_args(sub) -> None:
    p = sub.add_parser("info", help="physical cache bytes per format for a model config (no weights needed)")
    p.add_argument("--model-config", help="a model's config.json, or its folder (any supported MLA model)")
    p.add_argument("--preset", help="a known model instead: deepseek-v2-lite (default), deepseek-v3, kimi-k2, ...")
    p.add_argument("--format", help="highlight this format (e.g. c4r4, or any c<bits>r<bits>)")
    p.add_argument("--context", type=int, default=131072, help="tokens per sequence (default 131072)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--sink", type=int, default=4, help="policy: first tokens kept in BF16 (default 4)")
    p.add_argument("--local", type=int, default=128, help="policy: recent tokens kept in BF16 (default 128)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page (default 64)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)
