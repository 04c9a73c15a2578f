"""``quantmla generate``: greedy generation from a model with a quantized dual-path cache.

Usage::

    quantmla generate --model smollm2-mla --format c4r4 --prompt "The quick brown fox" --max-new-tokens 32
    quantmla generate --model DIR --format c2r4 --prompt-file prompt.txt --absorbed
    quantmla generate --model smollm2-mla --device cuda --dtype bfloat16 --prompt "..."  # kernels, absorbed form
    quantmla generate --model smollm2-mla --device cuda --dtype bfloat16 --graph --prompt "..."  # + captured step

Prints the continuation, the speed, and the cache's bytes: what the format needs on a BF16 model (the physical
size, as ``quantmla info`` counts it) and what this process allocated for it.
"""

from __future__ import annotations

import argparse
import time

from quantmla.cli_support import UsageError, usage_errors
from quantmla.models.names import MODEL_HELP, check_model_name


def add_generate_args(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text with a quantized dual-path cache (greedy)")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--format", default="c4r4", help="cache format: bf16, c8r8, c4r4 (default), c2r4, any c<b>r<b>")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-file", help="read the text to continue from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--sink", type=int, default=4, help="policy: first tokens kept in full precision (default 4)")
    p.add_argument("--local", type=int, default=128, help="policy: recent tokens kept in full precision (default 128)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model weights dtype (default float32)")  # fmt: skip
    p.add_argument("--absorbed", action="store_true", help="attend in absorbed form over the quantized cache")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model and its cache run (default cpu); cuda attends in absorbed form, through the "
                        "fused writer and the decode kernels")  # fmt: skip
    p.add_argument("--graph", action="store_true",
                   help="with --device cuda: capture the decode step in a CUDA graph and replay it per token "
                        "(quantmla.cache.graph; no per-operator launch overhead)")  # fmt: skip
    p.set_defaults(func=cmd_generate)
    return p


def _prompt_text(args) -> str:
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot read it as UTF-8 text ({e})") from None
    else:
        text = args.prompt
    if not text.strip():
        raise UsageError("the prompt is empty; give some text to continue with --prompt TEXT or --prompt-file FILE")
    return text


def check_generate_args(args):
    """Everything that can be checked before the model loads; returns (format, policy, prompt text)."""
    from quantmla.quant.formats import CachePolicy, get_format

    text = _prompt_text(args)
    if args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: give a positive number of tokens")
    if getattr(args, "graph", False) and getattr(args, "device", "cpu") != "cuda":
        raise UsageError("--graph captures the decode step in a CUDA graph: it needs --device cuda")
    if getattr(args, "device", "cpu") == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible here; run on a GPU machine or use --device cpu")
    with usage_errors():
        fmt = get_format(args.format)
        policy = CachePolicy(sink=args.sink, local=args.local)
        check_model_name(args.model)
    return fmt, policy, text


def byte_report(rep: dict) -> str:
    """The cache line of the report: physical bytes of the format on a BF16 model vs what this process holds."""
    fmt, phys, bf16 = rep["format"], rep["physical_bytes_bf16_model"], rep["bf16_cache_bytes"]
    if fmt.lower() == "bf16":
        size = f"BF16 cache, {phys:,} B on a BF16 model"
    else:
        size = f"{fmt.upper()} needs {phys:,} B on a BF16 model ({bf16 / phys:.2f}x less than BF16's {bf16:,} B)"
    return (
        f"cache: {rep['tokens']} tokens x {rep['layers']} layers; {size}; this process allocated "
        f"{rep['allocated_bytes']:,} B (pages, BF16 sink/local copies, block table)"
    )


def cmd_generate(args) -> int:
    fmt, policy, text = check_generate_args(args)
    import torch

    from quantmla.cache.hf import QuantMLACache, rope_rounding_of
    from quantmla.compat import with_cache
    from quantmla.models.names import resolve_model

    model, tok, _ = resolve_model(args.model, args.dtype)
    device = getattr(args, "device", "cpu")
    model = model.to(device)
    ids = tok(text, return_tensors="pt").input_ids.to(device)  # [1, T]
    if ids.shape[1] == 0:
        raise UsageError("the prompt gives no tokens; give some text to continue")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + args.max_new_tokens > limit:
        raise UsageError(
            f"the prompt is {ids.shape[1]} tokens + --max-new-tokens {args.max_new_tokens} > the model's context of "
            f"{limit} tokens (max_position_embeddings); shorten the prompt or lower --max-new-tokens"
        )
    with usage_errors(f"--model {args.model}: "):  # pages for the whole generation, allocated at the first write
        cache = QuantMLACache(model.config, fmt, policy, max_length=ids.shape[1] + args.max_new_tokens,
                              rope_rounding=rope_rounding_of(model))  # a calibrated folder's RoPE rounding
    if args.absorbed or device == "cuda":
        from quantmla.mla.attention import enable_absorbed_attention

        enable_absorbed_attention(model)
    t0 = time.perf_counter()
    if getattr(args, "graph", False):
        from quantmla.cache.graph import greedy_generate

        with usage_errors("--graph: "):
            out = greedy_generate(model, ids, cache, args.max_new_tokens, model.generation_config.eos_token_id)
    else:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **with_cache(cache))
    dt = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    print(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    print(f"\n[{fmt.name}] {new} tokens in {dt:.2f} s ({new / dt:.1f} tok/s, wall clock incl. the prompt's prefill)")
    print(byte_report(cache.memory_report()))
    return 0
